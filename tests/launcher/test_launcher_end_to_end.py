"""dtorch-launch with the real core runtime: a (2,) mesh on two ssh hosts, checked against torch."""
import json
import os
import signal

import pytest
import torch

from launch_helpers import (launch_mesh_script, read_tagged_line, ssh_server_address, stop_controller,
                            wait_gone)

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(60)]


def test_mesh_over_two_hosts_matches_torch(sshd_hosts, tmp_path):
    controller, stderr_path = launch_mesh_script(sshd_hosts.ssh_config, ["host-a", "host-b"], tmp_path)
    pids = []
    try:
        workers = json.loads(read_tagged_line(controller.stdout, "WORKERS ", stderr_path))
        pids = [worker["pid"] for worker in workers]
        # dtorch.workers() shows each worker's own host name; the ssh session tells which host it is.
        assert [w["rank"] for w in workers] == [0, 1]
        assert [ssh_server_address(pid) for pid in pids] == ["127.0.0.2", "127.0.0.3"]
        assert read_tagged_line(controller.stdout, "OK", stderr_path) == ""
        assert controller.wait(20) == 0, stderr_path.read_text()
        assert all(wait_gone(pid, 10) for pid in pids), "workers outlived dtorch.shutdown()"
        assert (tmp_path / "logs" / "rank1.log").exists()
    finally:
        stop_controller(controller, pids)


def test_controller_sigkill_ends_remote_workers(sshd_hosts, tmp_path):
    controller, stderr_path = launch_mesh_script(sshd_hosts.ssh_config, ["host-a", "host-b"], tmp_path, "--wait")
    pids = []
    try:
        pids = [worker["pid"] for worker in json.loads(read_tagged_line(controller.stdout, "WORKERS ", stderr_path))]
        read_tagged_line(controller.stdout, "WAITING", stderr_path)
        controller.send_signal(signal.SIGKILL)
        controller.wait(10)
        for pid in pids:
            assert wait_gone(pid, 10), f"worker {pid} still running 10 s after its controller was killed"
    finally:
        stop_controller(controller, pids)


def test_a_host_dying_mid_run_is_reported_within_seconds(sshd_hosts, tmp_path):
    controller, stderr_path = launch_mesh_script(sshd_hosts.ssh_config, ["host-a", "host-b"], tmp_path, "--lose")
    pids = []
    try:
        pids = [worker["pid"] for worker in json.loads(read_tagged_line(controller.stdout, "WORKERS ", stderr_path))]
        read_tagged_line(controller.stdout, "READY", stderr_path)
        os.kill(pids[1], signal.SIGKILL)               # the remote worker of rank 1, on host-b
        controller.stdin.write("go\n")
        controller.stdin.flush()
        seconds, message = read_tagged_line(controller.stdout, "LOST ", stderr_path).split(" ", 1)
        assert float(seconds) < 5, message
        assert "rank 1" in message and "host-b" in message and str(pids[1]) in message, message
        assert controller.wait(20) == 0, stderr_path.read_text()
    finally:
        stop_controller(controller, pids)


def start_failure(ssh_config, host_names, directory, *script_args) -> str:
    """The STARTUP message of a launch that must fail: within 30 s, the controller then exiting 0."""
    controller, stderr_path = launch_mesh_script(ssh_config, host_names, directory, *script_args)
    try:
        seconds, message = read_tagged_line(controller.stdout, "STARTUP ", stderr_path).split(" ", 1)
        assert float(seconds) < 30, message
        assert controller.wait(20) == 0, stderr_path.read_text()
        return message
    finally:
        stop_controller(controller, [])


def test_a_cuda_slot_on_a_host_without_a_gpu_fails_the_start_naming_it(sshd_hosts, tmp_path):
    """The controller cannot see remote GPUs; each worker checks its own before it registers,
    and the start fails with the worker's reason and its host."""
    if torch.cuda.device_count():
        pytest.skip("this host has a GPU: the remote workers would start")
    message = start_failure(sshd_hosts.ssh_config, ["host-a", "host-b"], tmp_path, "--cuda")
    assert "host-a" in message or "host-b" in message, message
    assert "cannot start" in message and "sees no GPU" in message, message


def test_an_unreachable_host_fails_the_start_naming_it(sshd_hosts, tmp_path):
    with open(sshd_hosts.ssh_config, "a") as config:   # a host whose address nobody listens on
        config.write("\nHost host-gone\n    HostName 127.0.0.9\n    Port 9\n")
    message = start_failure(sshd_hosts.ssh_config, ["host-a", "host-gone"], tmp_path)
    assert "host-gone" in message or "127.0.0.9" in message, message


def test_llama_from_pretrained_over_two_hosts_equals_transformers(sshd_hosts, tmp_path):
    """The issue's "over dtorch-launch": a save_pretrained directory (on a path both hosts see),
    loaded by the workers themselves onto a tp mesh spanning two ssh hosts."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path / "model")
    ids = torch.randint(0, 64, (2, 6))
    controller, stderr_path = launch_mesh_script(sshd_hosts.ssh_config, ["host-a", "host-b"], tmp_path,
                                                 str(tmp_path / "model"), json.dumps(ids.tolist()),
                                                 script="llama_over_ssh.py")
    try:
        logits = torch.tensor(json.loads(read_tagged_line(controller.stdout, "LOGITS ", stderr_path)))
        tokens = torch.tensor(json.loads(read_tagged_line(controller.stdout, "TOKENS ", stderr_path)))
        assert read_tagged_line(controller.stdout, "BYTES ", stderr_path) == "0"
        assert controller.wait(30) == 0, stderr_path.read_text()
    finally:
        stop_controller(controller, [])
    with torch.no_grad():
        assert (logits - reference(ids).logits).abs().max().item() < 1e-4
        expected = reference.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0,
                                      attention_mask=torch.ones_like(ids))
    assert torch.equal(tokens, expected)
