"""Hostfile parsing: the DeepSpeed/MPI `host slots=N` format, and errors that name file and line."""
import getpass
import shutil

import pytest

from dtorch_launcher import (Host, HostfileError, SshOptions, check_distinct_hosts, controller_host, load_hostfile,
                             parse_hostfile)
from dtorch_launcher.hostfile import parse_hostfile_text
from dtorch_launcher.relays import Relays

pytestmark = pytest.mark.timeout(60)


def test_hosts_slots_users_ports_comments_and_blank_lines(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the cluster\n\nnode1 slots=4\n  alice@node2   slots=2 port=2222  # gpu box\n"
                    "10.0.0.7\nnode3.example.com port=22 slots=8\n")
    assert parse_hostfile(path) == [
        Host("node1", slots=4),
        Host("node2", slots=2, user="alice", port=2222),
        Host("10.0.0.7", slots=1),
        Host("node3.example.com", slots=8, port=22),
    ]


def test_destination_is_what_ssh_gets():
    assert Host("node2", user="alice").destination == "alice@node2"
    assert Host("node2").destination == "node2"


@pytest.mark.parametrize("line, reason", [
    ("node1 slots=0", "slots must be a positive integer"),
    ("node1 slots=-2", "slots must be a positive integer"),
    ("node1 slots=four", "slots must be a positive integer"),
    ("node1 slots=", "slots must be a positive integer"),
    ("node1 slots=2 slots=3", "slots given twice"),
    ("node1 gpus=2", "unknown setting 'gpus=2'"),
    ("node1 4", "unknown setting '4'"),
    ("node1 port=70000", "out of range"),
    ("-oProxyCommand=evil slots=1", "bad host name"),
    ("node;rm slots=1", "bad host name"),
    ("@node1", "bad host name"),
    ("bad user@node1", "unknown setting"),
    ("al$ce@node1", "bad user name"),
])
def test_bad_line_names_file_line_and_reason(tmp_path, line, reason):
    path = tmp_path / "hosts"
    path.write_text(f"# header\nnode0 slots=1\n{line}\n")
    with pytest.raises(HostfileError, match=reason) as caught:
        parse_hostfile(path)
    assert caught.value.line_number == 3
    assert str(caught.value).startswith(f"{path}:3: ")


def test_duplicate_host_names_its_first_line():
    with pytest.raises(HostfileError, match=r"hosts:4: host node1 is already listed on line 1"):
        parse_hostfile_text("node1 slots=2\nnode2\n\nnode1 slots=2\n", "hosts")


def test_same_machine_on_two_ports_is_allowed():
    hosts = parse_hostfile_text("localhost port=2222\nlocalhost port=2223\n")
    assert [host.port for host in hosts] == [2222, 2223]


def test_empty_hostfile_is_an_error():
    with pytest.raises(HostfileError, match="no hosts"):
        parse_hostfile_text("# nothing here\n\n", "hosts")


def test_errors_are_value_errors_and_missing_files_are_os_errors(tmp_path):
    assert issubclass(HostfileError, ValueError)
    with pytest.raises(FileNotFoundError):
        parse_hostfile(tmp_path / "missing")


# --- one host, however it is written: compared after ssh's config and name resolution ----------

needs_ssh = pytest.mark.skipif(shutil.which("ssh") is None, reason="the OpenSSH client (ssh -G) is not installed")
ME = getpass.getuser()
# -F /dev/null: the user's own ~/.ssh/config must not change what these lines mean
NO_CONFIG = SshOptions(ssh_options=["-F", "/dev/null"])
SAME_AS_127_0_0_1 = ["localhost", f"{ME}@127.0.0.1", "127.0.0.1 port=22", f"{ME}@localhost port=22 slots=3",
                     "127.0.0.5", "::1"]


@pytest.mark.parametrize("second", SAME_AS_127_0_0_1)
def test_one_host_written_two_ways_is_refused_naming_both_lines(tmp_path, second):
    path = tmp_path / "hosts"
    path.write_text(f"# cluster\n127.0.0.1 slots=2\n{second}\n")
    with pytest.raises(HostfileError) as caught:
        load_hostfile(path, NO_CONFIG)
    message = str(caught.value)
    assert caught.value.line_number == 3, message
    assert message.startswith(f"{path}:3: ") and "same host as line 2 ('127.0.0.1 slots=2')" in message, message
    assert f"both reach {ME}@this machine (loopback) port 22" in message and repr(second) in message, message


def test_other_users_and_ports_of_one_machine_are_other_hosts(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("127.0.0.1 port=2222 slots=2\nlocalhost port=2223\nsomeone@localhost\nlocalhost\n")
    hosts = load_hostfile(path, NO_CONFIG)
    assert [(h.user, h.port, h.slots) for h in hosts] == [(None, 2222, 2), (None, 2223, 1), ("someone", None, 1),
                                                          (None, None, 1)]
    assert [h.line_number for h in hosts] == [1, 2, 3, 4]


@needs_ssh
def test_an_ssh_config_alias_is_the_host_it_names(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(f"Host box\n  HostName 127.0.0.1\n  User {ME}\nHost box2222\n  HostName localhost\n  Port 2222\n")
    options = SshOptions(ssh_options=["-F", str(config)])
    (tmp_path / "same").write_text("box\nlocalhost slots=2\n")
    with pytest.raises(HostfileError, match=r"same:2: localhost is the same host as line 1 \('box'\)"):
        load_hostfile(tmp_path / "same", options)
    (tmp_path / "other_port").write_text("box2222\nlocalhost\n127.0.0.1 port=2223\n")
    assert len(load_hostfile(tmp_path / "other_port", options)) == 3
    (tmp_path / "same_port").write_text("box2222\n127.0.0.1 port=2222\n")
    with pytest.raises(HostfileError, match="same_port:2: .*same host as line 1 .*port 2222"):
        load_hostfile(tmp_path / "same_port", options)


def test_a_name_that_does_not_resolve_is_an_error_naming_its_line(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("127.0.0.1\nnode7.invalid slots=2\n")
    with pytest.raises(HostfileError, match=r"hosts:2: cannot resolve host 'node7.invalid': .*'node7.invalid slots=2'"):
        load_hostfile(path, NO_CONFIG)
    path.write_text("127.0.0.1\n" + "a" * 1000 + "\n")   # 1000 characters: the resolver refuses the label
    with pytest.raises(HostfileError, match="hosts:2: cannot resolve host 'aaaa") as caught:
        load_hostfile(path, NO_CONFIG)
    assert len(str(caught.value)) < 600


def test_a_100000_character_host_name_is_refused_by_the_parser_in_a_short_message(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a" * 100_000 + " slots=2\n")
    with pytest.raises(HostfileError, match="hosts:1: host name of 100000 characters") as caught:
        parse_hostfile(path)
    assert len(str(caught.value)) < 400 and "(100008 characters)" in str(caught.value)


@needs_ssh
def test_hosts_behind_a_jump_host_are_compared_by_name_unresolved(tmp_path):
    """The jump host resolves them, not this machine: no resolution error, the names compared."""
    options = SshOptions(ssh_options=["-F", "/dev/null", "-o", "ProxyJump=gateway"])
    path = tmp_path / "hosts"
    path.write_text("node1.invalid slots=4\nnode2.invalid slots=4\n")
    assert len(load_hostfile(path, options)) == 2
    path.write_text("node1.invalid slots=4\nNODE1.invalid port=22\n")
    with pytest.raises(HostfileError, match=f"hosts:2: .*both reach {ME}@node1.invalid port 22"):
        load_hostfile(path, options)


def test_hosts_made_in_code_are_checked_too():
    with pytest.raises(HostfileError, match="127.0.0.1 is the same host as localhost"):
        check_distinct_hosts([Host("localhost"), Host("127.0.0.1")], NO_CONFIG)


def test_the_controller_listens_on_127_0_0_1_for_any_loopback_host():
    assert controller_host([Host("localhost")], NO_CONFIG) == "127.0.0.1"
    assert controller_host([Host("127.0.0.5")], NO_CONFIG) == "127.0.0.1"


class _Running:
    pid = None

    def poll(self):
        return None


def test_two_users_on_one_machine_get_a_relay_each():
    """A relay's directory is private to its user: bob's workers cannot use alice's relay."""
    relays = Relays(NO_CONFIG, True, lambda host, options, text, name: _Running())
    config = {"command_address": "tcp://10.0.0.1:5000"}
    alice, bob = Host("node1", slots=2, user="alice"), Host("node1", slots=2, user="bob")
    routed = [relays.route(host, [0, 1], config, "\n")[0]["relay_address"] for host in (alice, bob, alice)]
    assert routed[0] != routed[1] and routed[0] == routed[2]
