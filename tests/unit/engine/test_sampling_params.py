import pytest

from fleetserve.engine.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -3),
        ("min_p", 1.2),
        ("n", 0),
        ("n", True),
        ("max_new_tokens", -1),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("stop_token_ids", [100]),
        ("stop_token_ids", [1.0]),
        ("stop", [""]),
        ("top_k", 10**20),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("repetition_penalty", float("inf")),
        ("frequency_penalty", float("nan")),
    ],
)
def test_out_of_range_names_the_field(field, value):
    sp = SamplingParams(**{field: value})
    with pytest.raises(SamplingParamsError) as err:
        sp.verify(vocab_size=100)
    assert err.value.param == field


def test_from_dict_normalises_stop_and_rejects_unknown():
    sp = SamplingParams.from_dict({"stop": "END", "temperature": 0})
    assert sp.stop == ["END"] and sp.is_greedy
    sp.verify(vocab_size=10)
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams.from_dict({"temprature": 1})
    assert err.value.param == "temprature"


def test_extreme_but_valid_top_k_and_seed_pass():
    SamplingParams(top_k=2**31 - 1, seed=2**63 - 1).verify(vocab_size=100)
    SamplingParams(seed=-(2**63)).verify(vocab_size=100)
