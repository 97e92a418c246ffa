"""pending.agree_from: the longest agreeing prefix of two prompts (strings or lists of ids) in a range,
against a brute-force count; the string path compares in place (``str.startswith`` at an offset)."""

from hypothesis import given, settings, strategies as st

from fleetserve.router.kv_events.pending import agree_from


def brute(a, b, lo, hi):
    n = lo
    while n < hi and a[n] == b[n]:
        n += 1
    return n


pairs = st.tuples(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40),
                  st.integers(0, 40), st.integers(0, 40))


@settings(max_examples=500, deadline=None)
@given(pairs)
def test_strings_and_lists_agree_with_a_count(case):
    a, b, x, y = case
    common = brute(a, b, 0, min(len(a), len(b)))
    lo = min(x, common)  # the contract: a[:lo] == b[:lo], hi <= both lengths
    hi = max(lo, min(y, len(a), len(b)))
    want = brute(a, b, lo, hi)
    assert agree_from(a, b, lo, hi) == want
    sa, sb = "".join(chr(0x4E00 + t) for t in a), "".join(chr(0x4E00 + t) for t in b)  # one character per id
    assert agree_from(sa, sb, lo, hi) == want


def test_a_long_shared_prefix_is_found_to_the_character():
    a = "x" * 1000 + "a" + "y" * 50
    b = "x" * 1000 + "b" + "y" * 50
    assert agree_from(a, b, 0, 1051) == 1000
    assert agree_from(a, b, 999, 1051) == 1000
    assert agree_from(a, a, 0, 1051) == 1051
    assert agree_from(list(a), list(b), 0, 1051) == 1000
