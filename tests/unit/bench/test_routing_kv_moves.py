"""benchmarks/routing_kv_moves.py: later turns classed by how they were sent and where they went."""

import json
import re

import pytest
from helpers.bench_module import load_bench


@pytest.fixture(scope="module")
def mv():
    return load_bench("routing_kv_moves")


def rec(rid, worker, direct, cached, prompt=100):
    return {"rid": rid, "worker": worker, "direct": direct, "cached": cached, "prompt": prompt}


def test_classes_follow_the_previous_turn_and_the_last_routed_worker(mv):
    recs = [
        # a: routed w1, routed w1 (stay), direct w2, routed back to w1 (the last routed worker)
        rec("c0-t0", "w1", False, 0), rec("c0-t1", "w1", False, 80), rec("c0-t2", "w2", True, 0),
        rec("c0-t3", "w1", False, 60),
        # b: direct w3 first, then routed to w3 (the direct worker), then routed to w4 (moved)
        rec("c1-t0", "w3", True, 0), rec("c1-t1", "w3", False, 70), rec("c1-t2", "w4", False, 10),
        # c: direct w2, routed to w1 with no routed turn before: elsewhere, none yet; t2 is missing
        rec("c2-t0", "w2", True, 0), rec("c2-t1", "w1", False, 5), rec("c2-t3", "w1", False, 90),
    ]
    got = mv.classify(recs)
    assert got == {
        "direct after routed: moved": (1, 0, 100),
        "routed after direct: elsewhere, no routed turn yet": (1, 5, 100),
        "routed after direct: to the direct worker": (1, 70, 100),
        "routed after direct: to the last routed worker": (1, 60, 100),
        "routed after routed: moved": (1, 10, 100),
        "routed after routed: stay": (1, 80, 100),
    }


def test_an_id_of_another_shape_is_refused(mv):
    with pytest.raises(ValueError, match="g0-p1"):
        mv.classify([rec("g0-p1", "w1", False, 0)])


def test_a_failed_request_is_left_out_not_counted_as_a_move(mv):
    """``--dump-requests`` keeps failures (worker null, 0 tokens): t1 failed, so t2 has no previous
    turn to compare with and is skipped; nothing is a move."""
    recs = [rec("c0-t0", "w1", False, 0), {"rid": "c0-t1", "worker": None, "direct": False, "cached": 0,
                                           "prompt": 0}, rec("c0-t2", "w1", False, 90)]
    assert mv.classify(recs) == {}


@pytest.mark.parametrize("text, says", [
    ("{not json", "requests-x-1-0.json: Expecting property name"),
    ('{"rid": "c0-t0"}', "not a list of request records"),
    ('[{"rid": "c0-t0", "worker": "w1"}, {"rid": "c0-t1", "worker": "w1"}]', "missing field 'direct'"),
    ('[{"rid": "g0-p1", "worker": "w1", "direct": false, "cached": 0, "prompt": 9}]', "is not c<conversation>-t<turn>"),
    ('[{"rid": "c0-t1", "worker": "w1", "direct": false, "cached": "5", "prompt": 9}]',
     "record 0 ('c0-t1'): cached = '5' is not a token count"),
    ('[{"rid": "c0-t1", "worker": "w1", "direct": "no", "cached": 5, "prompt": 9}]', "direct = 'no' is not bool"),
    ('[{"rid": "c0-t1", "worker": "w1", "direct": false, "cached": -5, "prompt": 9}]', "cached = -5 is not a token"),
    ('[{"rid": null, "worker": "w1", "direct": false, "cached": 5, "prompt": 9}]', "rid = None is not str"),
    ('[{"rid": "c0-t1", "worker": "w1", "direct": false, "cached": 5, "prompt": 9, "route": 5}]',
     "route = 5 is not str or null"),
    ('[5]', "record 0 is a int, not an object"),
    ("[" * 100000 + "]" * 100000, "maximum recursion depth"),
])
def test_an_unreadable_dump_is_named_in_one_line(mv, tmp_path, text, says):
    f = tmp_path / "requests-x-1-0.json"
    f.write_text(text)
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        mv.read_records(f)
    assert str(e.value).startswith(str(f))


def test_shortfalls_count_routed_requests_that_found_less_than_predicted(mv):
    """Only served routed requests with a numeric prediction count; over-finding is not a shortfall."""
    def routed(rid, pred, cached, worker="w1"):
        r = rec(rid, worker, False, cached)
        r["route"] = f"target=http://{worker}; dp_rank=-; branch=exact; cached_tokens={pred}; prompt_tokens=100"
        return r
    recs = [
        routed("c0-t1", 64, 64),            # as predicted
        routed("c1-t1", 96, 32),            # 64 lost
        routed("c2-t1", 16, 48),            # found more: not short
        routed("c3-t1", 80, 0),             # 80 lost
        {**routed("c4-t1", 90, 0), "worker": None},  # failed: left out
        {**rec("c5-t1", "w2", True, 0), "route": None},  # direct: left out
        {**rec("c6-t1", "w1", False, 10), "route": "target=http://w1; dp_rank=-; branch=fallback; "
                                                    "cached_tokens=-; prompt_tokens=-; reason=text"},
    ]
    assert mv.shortfalls(recs) == (4, 64 + 96 + 16 + 80, 2, 64 + 80, 64 + 32 + 48 + 0)


def test_the_table_has_a_shortfall_row_per_run(mv, tmp_path):
    r = rec("c0-t1", "w1", False, 10)
    r["route"] = "target=http://w1; dp_rank=-; branch=exact; cached_tokens=40; prompt_tokens=100"
    (tmp_path / "requests-kv_aware-60-0.json").write_text(json.dumps([rec("c0-t0", "w1", False, 0), r]))
    out = mv.table([tmp_path / "requests-kv_aware-60-0.json"])
    assert "| kv_aware-60-0 | 1 | 1 | 40 | 30 | 75.0% | 15.0 |" in out  # 30 of 200 prompt tokens served


def test_a_dump_path_that_cannot_be_read_is_named_in_one_line(mv, tmp_path):
    """A directory or a broken link under a dump's name: OSError, named like any unreadable dump."""
    (tmp_path / "requests-a-1-0.json").mkdir()
    (tmp_path / "requests-b-1-0.json").symlink_to(tmp_path / "nowhere")
    for name in ("requests-a-1-0.json", "requests-b-1-0.json"):
        with pytest.raises(ValueError, match=re.escape(str(tmp_path / name))):
            mv.table([tmp_path / name])
