"""The engine's front door for servers: `EngineClient` (engine in a child process or a thread,
the output processor on the client's side or in a detokenizer process). See `engine_client`."""

from mla_backend.client.engine_client import (
    EngineClient,
    EngineStartError,
    InProcessClient,
    ProcessClient,
    default_torch_threads,
    make_client,
)

__all__ = ["EngineClient", "EngineStartError", "InProcessClient", "ProcessClient",
           "default_torch_threads", "make_client"]
