"""Fuzzing the hostfile parser and the launcher's options: every malformed input is the parser's
own error (HostfileError, OptionsError) with a message, never another exception."""
import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from dtorch_launcher import ENV_OPTIONS, HostfileError, OptionsError, SshOptions
from dtorch_launcher.hostfile import parse_hostfile_text

EXAMPLES = settings(max_examples=int(os.environ.get("DTORCH_FUZZ_EXAMPLES", 600)),
                    derandomize="DTORCH_FUZZ_EXAMPLES" not in os.environ, deadline=None, database=None)

WORDS = st.sampled_from(["node1", "alice@node2", "10.0.0.7", "@x", "a@", "slots=2", "slots=0", "port=22",
                         "port=70000", "slots=²", "slots=" + "9" * 5000, "port=", "=", "#", "x=1", "slots=1",
                         "::1", "[::1]", "ü", "\t", "\0", "a b", "user@@host", "-oProxyCommand=x"])
LINES = st.lists(st.one_of(WORDS, st.text(max_size=12)), max_size=5).map(" ".join)


@EXAMPLES
@given(st.lists(LINES, max_size=6).map("\n".join))
def test_every_hostfile_parses_or_fails_with_a_hostfile_error(text):
    try:
        hosts = parse_hostfile_text(text, "fuzz")
    except HostfileError as error:
        assert str(error)
        return
    assert hosts and all(h.slots >= 1 and (h.port is None or 1 <= h.port <= 65535) for h in hosts)


JSON_VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                           max_leaves=8)
FIELDS = st.sampled_from(["python", "chdir", "env", "ssh_options", "log_dir", "connect_timeout",
                          "worker_module", "other"])


@EXAMPLES
@given(st.one_of(st.dictionaries(FIELDS, JSON_VALUES, max_size=4).map(json.dumps),
                 JSON_VALUES.map(json.dumps), st.text(max_size=30)))
def test_every_options_text_loads_or_fails_with_an_options_error(text):
    try:
        options = SshOptions.from_environment({ENV_OPTIONS: text})
    except OptionsError as error:
        assert str(error)
        return
    assert isinstance(options.env, list) and options.connect_timeout > 0
