"""examples/train_llama.py under dtorch-launch, as docs/design/training.md shows it: dp 2 with one worker on
each of two ssh hosts trains, and each worker writes its own shards of the checkpoint into --out."""
import json

import pytest

from launch_helpers import REPOSITORY, launch_mesh_script, read_tagged_line, stop_controller

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(180)]

EXAMPLE = REPOSITORY / "examples" / "train_llama.py"


def test_the_training_example_runs_over_two_ssh_hosts(sshd_hosts, tmp_path):
    out, log = tmp_path / "run", tmp_path / "losses.jsonl"
    controller, stderr_path = launch_mesh_script(sshd_hosts.ssh_config, ["host-a", "host-b"], tmp_path,
                                                 "--steps", "3", "--sample", "0", "--log-every", "1", "--out",
                                                 str(out), "--log-json", str(log), script=str(EXAMPLE))
    try:
        assert "tokens/s" in read_tagged_line(controller.stdout, "step 3/3  loss ", stderr_path)
        assert read_tagged_line(controller.stdout, "loss plot: ", stderr_path).startswith(str(out / "loss.png"))
        assert controller.wait(60) == 0, stderr_path.read_text()
    finally:
        stop_controller(controller, [])
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert {p.name for p in (out / "checkpoint").iterdir()} >= {"checkpoint.json", "__0_0.safetensors",
                                                                "__1_0.safetensors"}
