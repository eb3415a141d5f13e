"""The `plait` command: serve's flags, start-up and SIGINT shutdown, generate; ServerProcess."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from plait.args import ServerArgs
from plait.cli import build_parser
from plait.launch import ServerProcess, cli_flags, free_port
from tests.procs import group_members

PLAIT = [sys.executable, "-m", "plait"]


def test_serve_help_documents_every_server_arg():
    out = subprocess.run(
        [*PLAIT, "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    flat = "".join(out.split())  # argparse wraps lines (also at hyphens)
    for f in dataclasses.fields(ServerArgs):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        assert flag in out, flag
        assert "".join(f.metadata["help"].split()) in flat, f.name


def test_server_args_round_trip_through_cli_flags(monkeypatch):
    monkeypatch.setenv("PLAIT_API_KEY", "k")  # the key travels in the environment, not argv
    args = ServerArgs(
        model_path="/m",
        port=1234,
        api_key="k",
        disable_radix_cache=True,
        schedule_policy="fcfs",
        mem_fraction_static=0.5,
        max_queued_requests=7,
    )
    flags = cli_flags(args)
    assert "k" not in flags
    ns = build_parser().parse_args(["serve", *flags])
    assert ServerArgs.from_cli_args(ns) == args


def test_bad_flag_values_fail_fast():
    run = subprocess.run(
        [*PLAIT, "serve", "--schedule-policy", "random"], capture_output=True, text=True
    )
    assert run.returncode == 2 and "schedule-policy" in run.stderr
    run = subprocess.run(
        [*PLAIT, "serve", "--max-running-requests", "0"], capture_output=True, text=True
    )
    assert run.returncode == 2 and "max_running_requests" in run.stderr


@pytest.mark.parametrize(
    "flag, value, field",
    [
        ("--port", "70000", "port"),
        ("--port", "-1", "port"),
        ("--context-length", "0", "context_length"),
        ("--context-length", "-4", "context_length"),
        ("--device", "gpu", "device"),  # was a torch traceback from the scheduler's start-up
        ("--device", "cuda:x", "device"),
    ],
)
def test_out_of_range_values_are_named_before_anything_starts(flag, value, field):
    run = subprocess.run(
        [*PLAIT, "serve", "--model", "/no/such/model", flag, value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert f"plait serve: {field}: " in run.stderr and "Traceback" not in run.stderr


def test_serve_on_a_busy_port_fails_before_loading(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        start = time.monotonic()
        run = subprocess.run(
            [*PLAIT, "serve", "--model", tiny_llama, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert run.returncode != 0 and "cannot bind" in run.stderr
    assert time.monotonic() - start < 20


def _break_config(d):
    (d / "config.json").unlink()


def _corrupt_config(d):
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]')


def _config_without_a_key(d):
    config = json.loads((d / "config.json").read_text())
    del config["hidden_size"]
    (d / "config.json").write_text(json.dumps(config))


def _no_weights(d):
    (d / "model.safetensors").unlink()


def _truncated_weights(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _garbage_weights(d):
    (d / "model.safetensors").write_bytes(b"\xff" * 4096)


def _no_tokenizer(d):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / name).unlink()


@pytest.mark.parametrize(
    "damage, named",
    [
        (_break_config, "config.json"),
        (_corrupt_config, "config.json"),
        (_config_without_a_key, "hidden_size"),
        (_no_weights, "safetensors"),
        (_truncated_weights, "model.safetensors"),
        (_garbage_weights, "model.safetensors"),
        (_no_tokenizer, "tokenizer"),
    ],
    ids=lambda v: getattr(v, "__name__", v).strip("_"),
)
def test_a_broken_checkpoint_is_named_and_leaves_nothing_running(
    tiny_llama, tmp_path, damage, named
):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    damage(model)
    proc = subprocess.Popen(
        [*PLAIT, "serve", "--model", str(model), "--port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("plait serve: ") and named in last and str(model) in last, err
        assert "Traceback" not in err, err
        assert not group_members(proc.pid)  # no child left behind
    finally:
        if proc.poll() is None or group_members(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("content", [None, '{"sk-a": ', '["sk-a"]'], ids=["missing", "bad-json", "list"])
def test_a_bad_api_key_file_is_named_before_the_model_loads(tmp_path, content):
    keys = tmp_path / "keys.json"
    if content is not None:
        keys.write_text(content)
    run = subprocess.run(
        [*PLAIT, "serve", "--model", "/no/such/model", "--api-key-file", str(keys)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1, run.stderr
    assert "api_key_file" in run.stderr and str(keys) in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "model_path" not in run.stderr, run.stderr


def test_server_process_rejects_unknown_args_before_starting():
    with pytest.raises(TypeError, match="max_runing_requests"):
        ServerProcess(max_runing_requests=3)


@pytest.mark.model
def test_serve_prints_url_and_sigint_stops_everything(tiny_llama):
    port = free_port()
    proc = subprocess.Popen(
        [
            *PLAIT,
            "serve",
            "--model",
            tiny_llama,
            "--port",
            str(port),
            "--max-total-tokens",
            "8192",
            "--log-level",
            "warning",
            # the 4000-token stream below must outlast 1 s + the grace period; with the default
            # 5 s grace a 3000-token stream finished before the deadline once decode got faster
            "--shutdown-grace",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        assert proc.stdout.readline().strip() == f"plait server ready at {url}"
        pids = httpx.get(url + "/get_server_info").json()["child_pids"]
        received = []

        def stream():  # in flight when the signal arrives
            body = {
                "text": "interrupted",
                "stream": True,
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
            }
            try:
                with httpx.stream("POST", url + "/generate", json=body, timeout=60) as resp:
                    received.extend(line for line in resp.iter_lines() if line)
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        time.sleep(1.0)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        assert time.monotonic() - start < 15
        t.join(10)
        # the stream was running; past the grace period it ends with an error event
        assert received[-1] == "data: [DONE]"
        assert '"service_unavailable"' in received[-2] and "shutting down" in received[-2]
        for pid in pids.values():
            with pytest.raises(ProcessLookupError):
                _wait_gone(pid)
        with socket.socket() as s:  # a new server can bind the port (as uvicorn does)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    """Raises ProcessLookupError once pid is gone (or a zombie); returns if it stays alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ")[1][0] == "Z":
                raise ProcessLookupError(pid)
        time.sleep(0.1)


def test_generate_prints_the_engines_text(tiny_llama, http):
    prompt = "The capital of France is"
    run = subprocess.run(
        [
            *PLAIT,
            "generate",
            "--model",
            tiny_llama,
            "--raw",
            "--prompt",
            prompt,
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",
            "--max-total-tokens",
            "4096",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    expected = http.post(
        "/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    ).json()["text"]
    assert run.stdout == expected + "\n"


def test_generate_rejects_bad_sampling_before_starting():
    run = subprocess.run(
        [*PLAIT, "generate", "--prompt", "x", "--temperature", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "temperature" in run.stderr


def test_no_merge_conflict_left_in_the_package():
    """A merge once left its conflict markers in plait/cli.py's docstring (the usage text)."""
    from pathlib import Path

    import plait
    import plait.cli

    root = Path(plait.__file__).parent
    for path in root.rglob("*.py"):
        lines = path.read_text().splitlines()
        assert not any(line.startswith(("<<<<<<< ", ">>>>>>> ")) for line in lines), path
    assert "plait generate --prompt TEXT [--raw]" in plait.cli.__doc__


def test_generate_help_documents_what_generate_uses():
    """`plait generate --help` lists the Engine's options, not the HTTP server's (a port, API
    keys, replicas: generate starts no server), and the defaults generate really has."""
    out = subprocess.run(
        [*PLAIT, "generate", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--prompt", "--raw", "--stream", "--json", "--model", "--max-total-tokens",
                 "--chunked-prefill-size", "--request-timeout", "--log-level"):
        assert flag in out, flag
    for flag in ("--host", "--port", "--api-key", "--api-key-file", "--served-model-name",
                 "--max-queued-requests", "--queue-reserve-fraction", "--shutdown-grace",
                 "--max-request-bytes", "--tool-call-parser", "--dp", "--router"):
        assert f"{flag} " not in out and f"{flag}\n" not in out, flag
    flat = " ".join(out.split())
    assert "logging level (default: warning)" in flat
    run = subprocess.run(
        [*PLAIT, "generate", "--prompt", "x", "--port", "1"], capture_output=True, text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "unrecognized arguments: --port" in run.stderr
    assert "Traceback" not in run.stderr

