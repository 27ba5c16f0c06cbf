import pytest

from transformer.data import toy
from transformer.data.sources import InMemory
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, build_tokenizer


def test_round_trip_cache_and_special_ids(tmp_path):
    src, tgt = toy.generate(800, 10, 10)["train"]
    tok = build_tokenizer(InMemory(src, tgt, "unit"), vocab_size=150, cache_dir=tmp_path)
    assert (tok.src.pad_id(), tok.src.unk_id(), tok.src.bos_id(), tok.src.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    ids = tok.encode_src(src[:20])
    assert all(PAD_ID not in s and EOS_ID not in s for s in ids)
    assert tok.decode_tgt(tok.encode_tgt(tgt[:20])) == tgt[:20]
    files = list((tmp_path / "spm").glob("*.model"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    again = build_tokenizer(InMemory(src, tgt, "unit"), vocab_size=150, cache_dir=tmp_path)  # cached: not retrained
    assert files[0].stat().st_mtime_ns == mtime and again.src_model_bytes == tok.src_model_bytes
    other = build_tokenizer(InMemory(src, tgt, "unit"), vocab_size=120, cache_dir=tmp_path)  # new settings: new model
    assert len(list((tmp_path / "spm").glob("*.model"))) == 2 and other.src_vocab_size <= 120
    restored = Tokenizer.from_state_dict(tok.state_dict())
    assert restored.encode_src(src[:5]) == tok.encode_src(src[:5])


def test_separate_vocabularies(tmp_path):
    src, tgt = toy.generate(800, 10, 10)["train"]
    tok = build_tokenizer(InMemory(src, tgt, "unit"), vocab_size=120, joint=False, cache_dir=tmp_path)
    assert not tok.joint
    assert tok.decode_tgt(tok.encode_tgt(tgt[:5])) == tgt[:5]
    assert Tokenizer.from_state_dict(tok.state_dict()).tgt_model_bytes == tok.tgt_model_bytes


def test_ctrl_c_while_sentencepiece_reads_the_corpus_stays_a_keyboard_interrupt():
    from transformer.data.tokenizer import train_sentencepiece

    def lines_until_ctrl_c():
        yield from (f"ein Hund {i}" for i in range(100))
        raise KeyboardInterrupt  # SentencePiece would turn it into "INTERNAL: ..." RuntimeError

    with pytest.raises(KeyboardInterrupt):
        train_sentencepiece(lines_until_ctrl_c(), vocab_size=30, model_type="bpe", character_coverage=1.0, sample=1000)
