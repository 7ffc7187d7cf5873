"""benchmarks/bench_server_path.py on the CPU: the whole benchmark with deepseek-v2-tiny and tiny
numbers (the in-process engine, tritonserver under perf_analyzer, our own client and genai-perf,
which `./build.sh setup` installs in .venv-genai-perf), its JSON file and its reading of
perf_analyzer's profile export."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_server_path as bsp  # noqa: E402

SIDES = ("in_process", "perf_analyzer", "own_client", "genai_perf")
SAME_REQUESTS = SIDES[:3]  # genai-perf draws its own (same output lengths here: all capped)
SCHEMA = ["date", "commit", "hardware", "command", "bf16", "fp8", "sweep"]
PEAK_KEYS = {"in_process_tok_s", "server_tok_s", "ratio"}
ROW_KEYS = {"concurrency", "side", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
            "itl_p99_ms"}


@pytest.mark.e2e
def test_end_to_end_on_cpu(tmp_path):
    """10 requests at once, then concurrency 1 (3 requests) and 4 (8 requests), outputs capped
    at 6 tokens, the own client in two processes: every side of every run gets exactly the
    tokens asked (genai-perf: asks for them, and its count by tokenizing the text is within
    10%: 59 of 60 measured), and the JSON holds the issue's schema with one sweep row per
    (concurrency, side)."""
    out, details = tmp_path / "out.json", tmp_path / "details.json"
    argv = ["--model", "deepseek-v2-tiny", "--device", "cpu", "--num-requests", "10",
            "--concurrency", "1", "4", "--sweep-min-requests", "3", "--max-output", "6",
            "--max-prompt", "48", "--client-procs", "2", "--json", str(out),
            "--details", str(details), "--server-param", "REPORT_CUSTOM_METRICS=true",
            "--clients", "perf_analyzer", "own_client", "genai_perf", "--log-compiles"]
    proc = subprocess.run([sys.executable, str(BENCH / "bench_server_path.py"), *argv],
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    for title in ("### Peak", "### Concurrency sweep", "### Targets",
                  "### Where the server's TTFT", "### genai-perf's own requests"):
        assert title in proc.stdout, log
    for client in ("perf_analyzer", "own_client"):  # the c=1 TTFTs paired request by request
        assert re.search(rf"\| {client} \| c=1: TTFT, median of the per-request differences "
                         r"\(server - in-process; not a target\) \| [+-]\d+\.\d\d ms \|",
                         proc.stdout), log

    doc = json.loads(out.read_text())
    assert list(doc) == SCHEMA
    assert "CPU cores" in doc["hardware"] and doc["command"].endswith(" ".join(argv))
    assert doc["fp8"] == dict.fromkeys(PEAK_KEYS)
    peak = doc["bf16"]
    assert set(peak) == PEAK_KEYS and peak["in_process_tok_s"] > 0 and peak["server_tok_s"] > 0
    assert peak["ratio"] == pytest.approx(peak["server_tok_s"] / peak["in_process_tok_s"])
    assert [(r["concurrency"], r["side"]) for r in doc["sweep"]] == [
        (c, side) for c in (1, 4) for side in SIDES]
    for row in doc["sweep"]:
        assert set(row) == ROW_KEYS
        assert row["tok_s"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]

    # Tokens asked, computed here from the length pairs: the first `count` requests, capped.
    pairs = bsp.load_length_pairs(bsp.DEFAULT_PATH, 10, seed=0)
    outs = [min(o, 6) for _, o in pairs]
    assert outs == [6] * 10  # so genai-perf's draws (mean 6, deviation 0) ask the same
    sides = json.loads(details.read_text())["sides"]
    assert sorted(sides) == sorted(SIDES)
    for side in SIDES:
        for label, count in (("peak", 10), ("c=1", 3), ("c=4", 8)):
            r = sides[side][label]
            assert r["requests"] == count, (side, label)
            assert r["expected_tokens"] == sum(outs[:count]), (side, label)
            if side in SAME_REQUESTS:
                assert r["output_tokens"] == r["expected_tokens"], (side, label)
                assert r["wrong_count"] == 0, (side, label)
            else:  # no per-request counts from genai-perf
                assert abs(r["output_tokens"] / r["expected_tokens"] - 1) <= 0.1, (side, label)
                assert r["wrong_count"] is None, (side, label)
            assert r["errors"] == [], (side, label)
            if label == "c=1" and side in SAME_REQUESTS:  # each request's TTFT, c=1 only
                assert len(r["ttft_ms"]) == count
                assert statistics.median(r["ttft_ms"]) == pytest.approx(r["ttft_p50_ms"],
                                                                        abs=0.01)
            else:
                assert "ttft_ms" not in r, (side, label)
            assert r["span_s"] * 1e3 >= r["e2e_p99_ms"] > 0  # first send to last token
            assert r["ttft_p50_ms"] < r["e2e_p50_ms"] and r["ttft_p99_ms"] < r["e2e_p99_ms"]
            assert r["client_cpu_s"] > 0
            assert (r.get("server_cpu_s", 0) > 0) == (side != "in_process"), (side, label)
            if side != "in_process":  # the adapter's TTFT (from the stub) within the client's
                assert 0 < r["stub_ttft_mean_ms"] < r["ttft_mean_ms"], (side, label)
            else:  # --log-compiles: kernel specializations and collections during the run
                assert isinstance(r["compiles"], list), label
                assert sorted(r["gc_pauses"]) == ["0", "1", "2"], label
                assert all(n >= 0 and 0 <= most <= total for n, total, most
                           in r["gc_pauses"].values()), label
    # the own client's loads over two processes (one at concurrency 1)
    assert [sides["own_client"][label]["client_procs"] for label in ("peak", "c=1", "c=4")] \
        == [2, 1, 2]
    assert sides["perf_analyzer"]["peak"]["tok_s"] / sides["in_process"]["peak"]["tok_s"] \
        == pytest.approx(peak["ratio"])
    # The server's engine loop (from its unload line): at least one step per token of the
    # c=1 runs of both clients (one request at a time), each taking time.
    loop = json.loads(details.read_text())["server_engine_loop"]
    assert loop["steps"] >= 2 * sum(outs[:3]) and loop["step_ms_per_step"] > 0, loop
    assert 1 <= loop["outputs_per_step"] and loop["idle_s"] >= 0, loop
    assert "server's engine process, whole run" in proc.stdout + proc.stderr, log


def test_paired_ttft_is_the_median_of_per_request_differences():
    """Server − in-process TTFT request by request (ms), the median of those differences; None
    when a request of either side got no tokens (the lists would not pair up)."""
    base = {"requests": 4, "per_request": [[0.010, 0, 0], [0.050, 0, 0], [0.020, 0, 0],
                                           [0.100, 0, 0]]}
    server = {"requests": 4, "per_request": [[0.013, 0, 0], [0.051, 0, 0], [0.030, 0, 0],
                                             [0.090, 0, 0]]}
    # differences +3, +1, +10, -10 ms: median +2 ms (the p50s differ by 3.5 ms)
    assert bsp.paired_ttft_ms(server, base) == pytest.approx(2.0)
    short = {"requests": 4, "per_request": server["per_request"][:3]}
    assert bsp.paired_ttft_ms(short, base) is None
    assert bsp.paired_ttft_ms(base, short) is None


def test_profile_export_token_counts(tmp_path):
    """perf_analyzer 2.48 exports a UINT32 output as its 4 raw bytes in a JSON string: control
    bytes escaped, a byte >= 0x80 written as it is (200 = 0xC8, not valid UTF-8)."""
    export = tmp_path / "profile.json"
    export.write_bytes(
        b'{"experiments":[{"experiment":{"mode":"concurrency","value":1},"requests":['
        b'{"timestamp":1000000000,"request_inputs":{"sampling_parameters":'
        b'"{\\"max_tokens\\": 201, \\"min_tokens\\": 201}","input_ids":null},'
        b'"response_timestamps":[1010000000,1030000000,1031000000],"response_outputs":['
        b'{"text_output":"a","num_output_tokens":"\\u0001\\u0000\\u0000\\u0000"},'
        b'{"text_output":"b","num_output_tokens":"\xc8\\u0000\\u0000\\u0000"},'
        b'{"text_output":"","num_output_tokens":""}]}],"window_boundaries":[1,2]}],'
        b'"version":"2.48.0","service_kind":"triton","endpoint":""}')
    trace, asked = bsp.read_profile(export)
    assert asked == {"0": 201}
    assert trace.sent == {"0": 1.0}
    assert trace.arrivals["0"] == [(1.01, 1), (1.03, 200)]
    result = bsp.trace_result(trace, asked)
    assert (result["output_tokens"], result["wrong_count"]) == (201, 0)
    ttft, itl, e2e = result["per_request"][0]
    assert ttft == pytest.approx(0.01) and e2e == pytest.approx(0.03)
    assert itl == pytest.approx(0.02 / 200)  # 200 tokens came with the second response
    assert result["span_s"] == pytest.approx(0.03)
    assert bsp.trace_result(trace, {"0": 200})["wrong_count"] == 1


def test_json_merge(tmp_path):
    """A bf16 run then an fp8 run without a sweep, both with --merge: one file with both peaks,
    the bf16 sweep and both commands; rewriting the same run's results changes nothing; without
    --merge the file is replaced."""
    path = tmp_path / "results.json"
    head = {"date": "d", "commit": "c", "hardware": "h", "command": "bf16 run"}
    bf16 = {"in_process_tok_s": 100.0, "server_tok_s": 95.0, "ratio": 0.95}
    sweep = [{"concurrency": c, "side": side, "tok_s": float(c), "ttft_p50_ms": 1.0,
              "ttft_p99_ms": 2.0, "itl_p50_ms": 3.0, "itl_p99_ms": 4.0}
             for c in (8, 1) for side in reversed(SIDES)]
    first = bsp.write_json(path, "bf16", head, bf16, sweep, merge=True)
    assert list(first) == SCHEMA and first["fp8"] == dict.fromkeys(PEAK_KEYS)
    assert [(r["concurrency"], r["side"]) for r in first["sweep"]] == [
        (c, side) for c in (1, 8) for side in SIDES]
    fp8 = {"in_process_tok_s": 130.0, "server_tok_s": 120.0, "ratio": 120 / 130}
    fp8_head = {**head, "command": "fp8 run"}
    for _ in range(2):
        doc = bsp.write_json(path, "fp8", fp8_head, fp8, [], merge=True)
        assert json.loads(path.read_text()) == doc
        assert (doc["bf16"], doc["fp8"], doc["sweep"]) == (bf16, fp8, first["sweep"])
        assert doc["command"] == "bf16 run && fp8 run"
    replaced = bsp.write_json(path, "fp8", fp8_head, fp8, sweep[:1], merge=False)
    assert replaced["bf16"] == dict.fromkeys(PEAK_KEYS) and replaced["sweep"] == sweep[:1]
    assert replaced["command"] == "fp8 run"


@pytest.mark.e2e
def test_server_side_only_with_a_server_parameter(tmp_path):
    """--no-in-process with --server-param: only the own client's peak runs, against a server
    whose model has the parameter (its load line names the GIL switch interval); the JSON has
    no in-process figure."""
    out, details, work = tmp_path / "out.json", tmp_path / "details.json", tmp_path / "work"
    argv = ["--model", "deepseek-v2-tiny", "--device", "cpu", "--num-requests", "6",
            "--concurrency", "--clients", "own_client", "--no-in-process", "--server-param",
            "GIL_SWITCH_INTERVAL_MS=0.25", "--max-output", "4", "--max-prompt", "32",
            "--json", str(out), "--details", str(details), "--workdir", str(work)]
    proc = subprocess.run([sys.executable, str(BENCH / "bench_server_path.py"), *argv],
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    doc = json.loads(out.read_text())
    assert doc["bf16"] == {"in_process_tok_s": None, "server_tok_s": None, "ratio": None}
    assert "CPU cores" in doc["hardware"]
    sides = json.loads(details.read_text())["sides"]
    assert list(sides) == ["own_client"]
    outs = [min(o, 4) for _, o in bsp.load_length_pairs(bsp.DEFAULT_PATH, 6, seed=0)]
    assert sides["own_client"]["peak"]["output_tokens"] == sum(outs)
    assert "GIL switch interval 0.25 ms;" in (work / "server.log").read_text(errors="replace")


def test_genai_perf_argv_draws_like_the_run(tmp_path):
    """genai-perf gets the mean prompt and output lengths of the run's requests and their
    standard deviations, each capped at a third of the mean (its draws below 1 prompt token are
    empty prompts), for exactly the run's requests and concurrency."""
    requests = [[[7] * 10, 100], [[7] * 50, 300], [[7] * 30, 500], [[7] * 99, 1]]
    run = bsp.Run("c=2", 3, 2)
    argv = bsp.genai_perf_argv(["genai-perf"], "host:1", requests, run, "/tok", tmp_path, 5)
    opt = {k: v for k, v in zip(argv, argv[1:]) if k.startswith("-")}
    assert argv[:2] == ["genai-perf", "profile"] and "--streaming" in argv
    assert (opt["--synthetic-input-tokens-mean"], opt["--synthetic-input-tokens-stddev"]) \
        == ("30", "10")  # std 16.3 capped at 30 / 3
    assert (opt["--output-tokens-mean"], opt["--output-tokens-stddev"]) == ("300", "100")
    assert "--output-tokens-mean-deterministic" in argv  # min_tokens = max_tokens
    assert (opt["--request-count"], opt["--num-prompts"], opt["--concurrency"]) == ("3", "3", "2")
    assert (opt["--endpoint-type"], opt["--backend"], opt["-u"]) == ("kserve", "vllm", "host:1")
    assert (opt["--tokenizer"], opt["--random-seed"]) == ("/tok", "5")
    warm = bsp.Run("warm-up", 2, 2, max_tokens=8, measured=False)  # outputs replaced
    argv = bsp.genai_perf_argv([], "h", requests, warm, "/t", tmp_path, 0)
    opt = {k: v for k, v in zip(argv, argv[1:]) if k.startswith("-")}
    assert (opt["--output-tokens-mean"], opt["--output-tokens-stddev"]) == ("8", "0")


@pytest.mark.e2e
def test_ttft_pairs_on_cpu(tmp_path):
    """benchmarks/bench_ttft_pairs.py with deepseek-v2-tiny: 2 warm-up prompts, then 4 pairs,
    each prompt sent to the in-process engine and then to tritonserver; every pair has both
    TTFTs, the summary is computed from them, and the targets table is printed."""
    details = tmp_path / "pairs.json"
    argv = ["--model", "deepseek-v2-tiny", "--device", "cpu", "--pairs", "4", "--warm-up", "2",
            "--max-output", "6", "--max-prompt", "48", "--details", str(details),
            "--server-param", "REPORT_CUSTOM_METRICS=true"]
    proc = subprocess.run([sys.executable, str(BENCH / "bench_ttft_pairs.py"), *argv],
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    for title in ("### Concurrency 1, 4 prompts", "### TTFT, server − in-process",
                  "### Where the server's TTFT goes", "### Targets (issue 41, concurrency 1)"):
        assert title in proc.stdout, log
    doc = json.loads(details.read_text())
    pairs, s = doc["pairs"], doc["summary"]
    assert len(pairs) == 4 and doc["engine_settings"]["max_total_tokens"] == "65536"
    pairs_expected = [min(o, 6) for _, o in bsp.load_length_pairs(bsp.DEFAULT_PATH, 6, seed=0)]
    assert [p["output_tokens"] for p in pairs] == pairs_expected[2:]
    for p in pairs:
        assert p["in_process_ttft_ms"] > 0 and p["server_ttft_ms"] > 0, p
        assert p["prompt_tokens"] <= 48
    diffs = sorted(p["server_ttft_ms"] - p["in_process_ttft_ms"] for p in pairs)
    assert s["ttft_diff_median_ms"] == pytest.approx((diffs[1] + diffs[2]) / 2)
    assert s["in_process_ttft_p50_ms"] == pytest.approx(
        statistics.median(p["in_process_ttft_ms"] for p in pairs))
    assert 0 < s["stub_ttft_mean_ms"] < s["server_ttft_mean_ms"]
