"""What the Python-backend stub's calls cost, inside a real stub of a real tritonserver.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python benchmarks/bench_stub_calls.py [--calls 2000]
        [--switch-intervals 5 0.5 0.1]

Serves a probe model (its model.py is `PROBE` below, written into a temporary repository) and
sends it one request over a gRPC stream. Inside `execute`, on the stub's main thread, the probe
times `--calls` calls of each kind the adapter makes (`serving.responder`, `serving.metrics`):
a histogram `observe` and a counter `increment` (each an IPC round trip to tritonserver), a
BYTES and a UINT32 `pb_utils.Tensor`, an `InferenceResponse`, `is_cancelled` (IPC) and a
streamed `send` (IPC). Then, for each GIL switch interval of `--switch-intervals` (ms,
`sys.setswitchinterval`), the two IPC calls again while another thread of the stub runs pure
Python without blocking: a thread that blocked waits for the GIL until the interval has passed
(CPython's GIL hand-off), which is what the adapter's sender threads and its `execute` meet
while the response thread computes. Prints per call the wall µs and the calling thread's CPU µs
(`time.thread_time`), as a table; `--json PATH` writes it too.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = """name: "probe"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "CALLS" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "INTERVALS_MS" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

PROBE = '''
import json
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.hist_family = pb_utils.MetricFamily(
            name="probe_seconds", description="probe", kind=pb_utils.MetricFamily.HISTOGRAM)
        self.hist = self.hist_family.Metric(labels={"probe": "1"}, buckets=[0.001, 0.01, 0.1])
        self.counter_family = pb_utils.MetricFamily(
            name="probe_total", description="probe", kind=pb_utils.MetricFamily.COUNTER)
        self.counter = self.counter_family.Metric(labels={"probe": "1"})

    def execute(self, requests):
        for request in requests:
            calls = int(pb_utils.get_input_tensor_by_name(request, "CALLS").as_numpy()[0])
            intervals = pb_utils.get_input_tensor_by_name(request, "INTERVALS_MS").as_numpy()
            sender = request.get_response_sender()
            text = np.array([b"token"], dtype=np.object_)
            count = np.array([1], dtype=np.uint32)
            tensor = pb_utils.Tensor("OUT", text)
            rows = []

            def timed(name, interval_ms, fn):
                wall, cpu = time.perf_counter(), time.thread_time()
                for _ in range(calls):
                    fn()
                rows.append([name, interval_ms, (time.perf_counter() - wall) / calls * 1e6,
                             (time.thread_time() - cpu) / calls * 1e6])

            def send():
                sender.send(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUT", text)]))

            own = sys.getswitchinterval() * 1e3
            timed("histogram observe", None, lambda: self.hist.observe(0.005))
            timed("counter increment", None, lambda: self.counter.increment(1))
            timed("Tensor, BYTES [1]", None, lambda: pb_utils.Tensor("OUT", text))
            timed("Tensor, UINT32 [1]", None, lambda: pb_utils.Tensor("OUT", count))
            timed("InferenceResponse", None,
                  lambda: pb_utils.InferenceResponse(output_tensors=[tensor]))
            timed("is_cancelled", None, sender.is_cancelled)
            timed("send (Tensor + response + send)", None, send)
            stop = threading.Event()

            def busy():
                x = 0
                while not stop.is_set():
                    for i in range(1000):
                        x += i

            spinner = threading.Thread(target=busy, daemon=True)
            spinner.start()
            try:
                for ms in (round(v, 4) for v in intervals.tolist()):
                    sys.setswitchinterval(ms / 1e3)
                    timed("histogram observe, busy thread", ms,
                          lambda: self.hist.observe(0.005))
                    timed("send, busy thread", ms, send)
            finally:
                stop.set()
                spinner.join()
                sys.setswitchinterval(own / 1e3)
            out = np.array([json.dumps({"own_interval_ms": own, "rows": rows}).encode()],
                           dtype=np.object_)
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", out)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        del self.hist, self.counter  # metrics before their families
        del self.hist_family, self.counter_family
'''


def probe(calls: int, intervals_ms: list[float], timeout_s: float) -> dict:
    """Serve the probe model and run it once: {"own_interval_ms", "rows": [[call, interval
    ms or None, wall µs, CPU µs], ...]}."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from mla_tools.tritonserver import TritonServer

    with tempfile.TemporaryDirectory(prefix="bench_stub_calls_") as tmp:
        model = Path(tmp) / "probe"
        (model / "1").mkdir(parents=True)
        (model / "config.pbtxt").write_text(CONFIG)
        (model / "1" / "model.py").write_text(PROBE)
        with TritonServer(Path(tmp), startup_timeout=timeout_s) as server:
            got: queue.SimpleQueue = queue.SimpleQueue()
            client = grpcclient.InferenceServerClient(server.grpc_url)
            client.start_stream(callback=lambda result, error: got.put((result, error)))
            inputs = [grpcclient.InferInput("CALLS", [1], "INT32"),
                      grpcclient.InferInput("INTERVALS_MS", [len(intervals_ms)], "FP32")]
            inputs[0].set_data_from_numpy(np.array([calls], dtype=np.int32))
            inputs[1].set_data_from_numpy(np.array(intervals_ms, dtype=np.float32))
            client.async_stream_infer("probe", inputs)
            deadline = time.monotonic() + timeout_s
            try:
                while True:  # the streamed "token" responses, then the result (FINAL)
                    result, error = got.get(timeout=max(deadline - time.monotonic(), 0.1))
                    if error is not None:
                        raise SystemExit(f"probe failed: {error}")
                    params = result.get_response().parameters
                    if params["triton_final_response"].bool_param:
                        return json.loads(result.as_numpy("OUT")[0])
            finally:
                client.stop_stream()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls of each kind")
    ap.add_argument("--switch-intervals", type=float, nargs="+", default=[5.0, 0.5, 0.1],
                    help="GIL switch intervals (ms) for the busy-thread rows")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = probe(args.calls, args.switch_intervals, args.timeout)
    print(f"\n### Python-backend stub calls ({args.calls:,} each; the stub's own GIL switch "
          f"interval {res['own_interval_ms']:g} ms)\n")
    print("| call | GIL switch interval ms | wall µs per call | CPU µs per call |")
    print("|---|---|---|---|")
    for name, ms, wall, cpu in res["rows"]:
        print(f"| {name} | {'' if ms is None else f'{ms:g}'} | {wall:,.1f} | {cpu:,.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"calls": args.calls, **res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
