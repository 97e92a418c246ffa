"""``fleetserve.models.config.gguf_reader`` parses a GGUF exactly as ``gguf.GGUFReader`` does."""

import gguf
import numpy as np

from fleetserve.models.config import gguf_reader


def _write(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_string("general.name", "tiny")
    w.add_token_list([f"tok{i}" for i in range(300)])
    w.add_token_scores([float(i) / 7 for i in range(300)])
    w.add_tensor("a.weight", np.arange(24, dtype=np.float32).reshape(4, 6))
    w.add_tensor("b.weight", np.arange(8, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_fields_and_tensors_equal_the_stock_readers(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path)
    ours, stock = gguf_reader(str(path)), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(stock.fields) and "tokenizer.ggml.tokens" in ours.fields
    for key, field in stock.fields.items():
        mine = ours.fields[key]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset), key
        assert [p.tobytes() for p in mine.parts] == [p.tobytes() for p in field.parts], key
    assert ours.fields["tokenizer.ggml.tokens"].contents()[:3] == ["tok0", "tok1", "tok2"]
    assert ours.fields["llama.block_count"].contents() == 3
    assert [t.name for t in ours.tensors] == ["a.weight", "b.weight"]
    for mine, theirs in zip(ours.tensors, stock.tensors):
        assert (mine.tensor_type, list(mine.shape), mine.data_offset) == (theirs.tensor_type, list(theirs.shape),
                                                                          theirs.data_offset)
        assert np.array_equal(mine.data, theirs.data) and mine.data.dtype == theirs.data.dtype
    assert np.array_equal(ours.tensors[0].data, np.arange(24, dtype=np.float32).reshape(4, 6))
    assert not isinstance(ours.data, np.memmap) and ours.data.base is not None  # a view of the mapping, no copy
