"""SshOptions round trips through the environment; the ssh and remote command lines it builds."""
import json
import shlex
import sys

import pytest

from dtorch_launcher import ENV_HOSTFILE, ENV_OPTIONS, Host, SshOptions, SshSpawner, spawner_from_environment
from dtorch_launcher.ssh import environment_lines, remote_command, ssh_command

pytestmark = pytest.mark.timeout(60)


def test_defaults_mirror_the_controller(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    options = SshOptions()
    assert (options.python, options.chdir) == (sys.executable, str(tmp_path))
    assert options.worker_module == "dtorch.runtime.processes.worker_process"


def test_environment_round_trip():
    options = SshOptions(python="/opt/py/bin/python", chdir="/srv/run", env=["HF_TOKEN"],
                         ssh_options=["-F", "cfg"], log_dir="/tmp/logs", connect_timeout=2.5)
    environment = options.to_environment()
    assert json.loads(environment[ENV_OPTIONS])["chdir"] == "/srv/run"
    assert SshOptions.from_environment(environment) == options


def test_from_environment_without_options_gives_defaults():
    assert SshOptions.from_environment({}) == SshOptions()


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"pyhton": "x"}', "unknown options"),
])
def test_from_environment_rejects_bad_values(text, message):
    with pytest.raises(ValueError, match=message):
        SshOptions.from_environment({ENV_OPTIONS: text})


@pytest.mark.parametrize("settings, message", [
    (dict(env=["HF_TOKEN=abc"]), "not environment variable names"),
    (dict(connect_timeout=0), "connect_timeout"),
    (dict(connect_timeout=float("nan")), "connect_timeout"),
    (dict(worker_module="a b"), "dotted module name"),
    (dict(python=""), "must not be empty"),
])
def test_bad_options_raise_value_errors(settings, message):
    with pytest.raises(ValueError, match=message):
        SshOptions(**settings)


def test_ssh_command_puts_user_options_first_and_never_prompts():
    options = SshOptions(ssh_options=["-o", "BatchMode=no", "-F", "cfg"], connect_timeout=2.5)
    argv = ssh_command(Host("node1", user="alice", port=2222), options)
    assert argv[:5] == ["ssh", "-o", "BatchMode=no", "-F", "cfg"]
    assert argv[5:] == ["-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3", "-p", "2222",
                        "alice@node1", remote_command(options)]


def test_remote_command_quotes_paths_and_carries_no_values():
    options = SshOptions(python="/opt/my python/bin/python", chdir="/srv/it's here", env=["SECRET"])
    command = remote_command(options)
    assert shlex.quote("/srv/it's here") in command
    assert command.endswith(f"exec {shlex.quote('/opt/my python/bin/python')} "
                            "-m dtorch.runtime.processes.worker_process")
    assert "SECRET" not in command


def test_environment_lines_skip_unset_and_end_with_an_empty_line():
    text = environment_lines(["A", "UNSET", "B"], {"A": "1 2 '$(x)'", "B": ""})
    assert text == "A=1 2 '$(x)'\nB=\n\n"


def test_environment_lines_refuse_newlines():
    with pytest.raises(ValueError, match="MULTI holds a newline"):
        environment_lines(["MULTI"], {"MULTI": "a\nb"})


def test_ranks_fill_slots_in_hostfile_order():
    spawner = SshSpawner([Host("node1", slots=4), Host("node2", slots=4)])
    assert spawner.capacity == 8
    assert [spawner.host_for(rank) for rank in (0, 3, 4, 7)] == ["node1", "node1", "node2", "node2"]
    assert [spawner.local_rank(rank) for rank in (0, 3, 4, 7)] == [0, 3, 0, 3]
    with pytest.raises(IndexError, match="rank 8 is outside the hostfile's 8 slots"):
        spawner.host_for(8)


def test_spawner_from_environment(tmp_path):
    assert spawner_from_environment({}) is None
    (tmp_path / "hosts").write_text("127.0.0.1 slots=2 port=2201\n127.0.0.1 port=2202\n")
    environment = {ENV_HOSTFILE: str(tmp_path / "hosts"), **SshOptions(chdir="/x").to_environment()}
    spawner = spawner_from_environment(environment)
    assert spawner.capacity == 3 and spawner.options.chdir == "/x"


def test_missing_ssh_client_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="OpenSSH client `ssh` is not installed"):
        SshSpawner([Host("node1")]).spawn(0, {})


def test_slots_are_counted_never_one_entry_each():
    """The defect: slots=999999999 in a hostfile was accepted and then materialized as one tuple
    per slot (about 100 GB). Ranks map to hosts by arithmetic now."""
    import tracemalloc
    tracemalloc.start()
    spawner = SshSpawner([Host("a", slots=2), Host("b", slots=999_999_999), Host("c", slots=1)])
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()
    assert spawner.capacity == 1_000_000_002
    assert [spawner.host_for(r) for r in (0, 1, 2, 1_000_000_000, 1_000_000_001)] == ["a", "a", "b", "b", "c"]
    assert [spawner.local_rank(r) for r in (1, 2, 1_000_000_000, 1_000_000_001)] == [1, 0, 999_999_998, 0]
    assert spawner.ranks_on(spawner.hosts[0]) == [0, 1] and spawner.ranks_on(spawner.hosts[2]) == [1_000_000_001]
    with pytest.raises(IndexError, match="outside the hostfile's 1000000002 slots"):
        spawner.host_for(1_000_000_002)
