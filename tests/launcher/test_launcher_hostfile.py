"""Hostfile parsing: the DeepSpeed/MPI `host slots=N` format, and errors that name file and line."""
import pytest

from dtorch_launcher import Host, HostfileError, parse_hostfile
from dtorch_launcher.hostfile import parse_hostfile_text

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
