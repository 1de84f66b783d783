"""engine_manager.lazyre: a pattern compiled on first use answers as ``re.compile``'s does, and nothing is compiled
before that use."""

from __future__ import annotations

import copy
import pickle
import re

from engine_manager.lazyre import lazy_re


def test_a_lazy_pattern_answers_as_the_compiled_one_and_compiles_only_when_used():
    source = r"(?P<n>\d+) (?P<unit>MiB|GiB)"
    re.purge()
    lazy, eager = lazy_re(source, re.I), re.compile(source, re.I)
    line = "buffer 512 mib, then 3 GiB"
    re.purge()
    assert "search" not in vars(lazy)                  # nothing compiled yet
    assert lazy.search(line).groupdict() == eager.search(line).groupdict() == {"n": "512", "unit": "mib"}
    assert [m.group(0) for m in lazy.finditer(line)] == [m.group(0) for m in eager.finditer(line)]
    assert lazy.sub("X", line) == eager.sub("X", line) and lazy.pattern == source and lazy.flags == eager.flags
    assert lazy.fullmatch("7 GiB") and not lazy.match("x 7 GiB")
    again = copy.deepcopy(lazy)
    assert again.search(line).group("n") == "512"
    assert pickle.loads(pickle.dumps(lazy_re(source))).search("9 MiB").group("n") == "9"
