"""Tokenizer loading, round trips, streaming decode, sandboxed chat templates, tiktoken (Kimi) dirs and errors."""
from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path

import pytest

from moestream.errors import MoestreamError, RequestError, TokenizerError
from moestream.bpe import default_training_text, train_bpe_tokenizer
from moestream.tokenizer import KIMI_PAT_STR, StreamDecoder, Tokenizer

MIXED_TEXT = "Hello, world! naïve café — 你好，世界 🌍🚀 emoji: 👩‍💻 Ünïcödé ✓\n\tdef f(x): return x ** 2\n"


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    text = default_training_text(200_000)
    chunks = [text[i:i + 4096] for i in range(0, len(text), 4096)]
    train_bpe_tokenizer(chunks, vocab_size=512, out_dir=out)
    return out


@pytest.fixture
def bpe_copy(bpe_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(bpe_dir, out)
    return out


def test_default_training_text_is_deterministic_and_bounded() -> None:
    a = default_training_text(50_000)
    assert a == default_training_text(50_000)
    assert 40_000 < len(a.encode("utf-8")) <= 50_000
    assert "def " in a


def test_trained_tokenizer_files_and_vocab(bpe_dir: Path) -> None:
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] is None
    assert sorted(v["content"] for v in config["added_tokens_decoder"].values()) == sorted(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = Tokenizer.load(bpe_dir)
    assert tok.vocab_size == 512
    assert tok.bos_token_id is None
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>")]
    assert tok.has_chat_template


@pytest.mark.parametrize("text", ["plain ascii: for i in range(10): print(i)", MIXED_TEXT, "", "  \n\n  "])
def test_round_trip(bpe_dir: Path, text: str) -> None:
    tok = Tokenizer.load(bpe_dir)
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_in_text_map_to_single_ids(bpe_dir: Path) -> None:
    tok = Tokenizer.load(bpe_dir)
    end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("hi<|im_end|>")
    assert ids[-1] == end and end not in ids[:-1]
    assert tok.decode(ids) == "hi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_stream_decoder_matches_decode_without_partial_chars(bpe_dir: Path) -> None:
    tok = Tokenizer.load(bpe_dir)
    ids = tok.encode(MIXED_TEXT * 3)
    assert len(ids) > len(MIXED_TEXT)  # the tiny vocab splits emoji/CJK into byte tokens
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == tok.decode(ids) == MIXED_TEXT * 3
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") > 0  # some pushes had to wait for the rest of a character


def test_stream_decoder_flush_emits_incomplete_tail(bpe_dir: Path) -> None:
    tok = Tokenizer.load(bpe_dir)
    ids = tok.encode("ok 🌍")
    stream = StreamDecoder(tok)
    text = "".join(stream.push(i) for i in ids[:-1])
    assert text == "ok "
    assert stream.flush() == "\ufffd"
    assert stream.flush() == ""


def test_chat_template_renders_chatml(bpe_dir: Path) -> None:
    tok = Tokenizer.load(bpe_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 你好<|im_end|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    prompt = tok.apply_chat_template(messages)
    assert prompt == expected + "<|im_start|>assistant\n"
    ids = tok.encode(prompt)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3 and tok.decode(ids) == prompt


def test_chat_template_file_takes_precedence_and_gets_helpers(bpe_copy: Path) -> None:
    (bpe_copy / "chat_template.jinja").write_text(
        "{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}|{{ tools }}\n"
        "{% for m in messages %}\n  {% if m %}{{ m.role }}{% endif %}\n{% endfor %}")  # trim/lstrip blocks
    tok = Tokenizer.load(bpe_copy)
    out = tok.apply_chat_template([{"role": "user", "content": "é<x>"}])
    assert out == '|<|im_end|>|[{"role": "user", "content": "é<x>"}]|None\nuser'


def test_chat_template_list_form_takes_default(bpe_copy: Path) -> None:
    cfg_path = bpe_copy / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    cfg_path.write_text(json.dumps(cfg))
    assert Tokenizer.load(bpe_copy).apply_chat_template([]) == "DEFAULT"


def test_raise_exception_in_template_is_a_request_error(bpe_copy: Path) -> None:
    (bpe_copy / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(RequestError, match="roles must alternate"):
        Tokenizer.load(bpe_copy).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{% set _ = messages.append({'role': 'x'}) %}{{ messages }}",
    "{{ messages[0].__class__.__mro__ }}",
])
def test_sandbox_refuses_escapes(bpe_copy: Path, template: str) -> None:
    (bpe_copy / "chat_template.jinja").write_text(template)
    tok = Tokenizer.load(bpe_copy)
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(TokenizerError, match="chat template"):
        tok.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "x"}]
    assert not (bpe_copy / "MARKER").exists() and not Path("MARKER").exists()


def test_malformed_template_is_a_tokenizer_error(bpe_copy: Path) -> None:
    (bpe_copy / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(TokenizerError, match="chat template"):
        Tokenizer.load(bpe_copy).apply_chat_template([])


def test_missing_chat_template(bpe_copy: Path) -> None:
    cfg_path = bpe_copy / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    tok = Tokenizer.load(bpe_copy)
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_eos_ids_merge_configs(bpe_copy: Path) -> None:
    (bpe_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 0], "bos_token_id": 1}))
    (bpe_copy / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    tok = Tokenizer.load(bpe_copy)
    end = tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == [end, 7, 0, 9]
    assert tok.bos_token_id == 1
    assert tok.encode("a", add_special_tokens=True) == tok.encode("a")  # no post-processor adds BOS here


def _write_kimi_dir(path: Path) -> dict[str, int]:
    path.mkdir()
    ranks = {bytes([b]): b for b in range(256)}
    merges = [b"he", b"ll", b"hell", b"hello", "你".encode(), "好".encode(), "你好".encode()]
    ranks.update({m: 256 + i for i, m in enumerate(merges)})
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in ranks.items()]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    specials = {"[BOS]": n, "[EOS]": n + 1, "<|im_end|>": n + 2, "<|im_user|>": n + 3}
    added = {str(i): {"content": s, "special": True} for s, i in specials.items()}
    template = "{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "[BOS]", "eos_token": "[EOS]", "added_tokens_decoder": added, "chat_template": template,
         "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": [n + 1, n + 2]}))
    return specials | {"hello": 259, "你好": 262, "n_base": n}


def test_tiktoken_model_dir(tmp_path: Path) -> None:
    ids = _write_kimi_dir(tmp_path / "kimi")
    n = ids["n_base"]
    tok = Tokenizer.load(tmp_path / "kimi")
    assert tok.vocab_size == n + 256
    assert tok.encode("hello") == [ids["hello"]]
    assert tok.encode("你好") == [ids["你好"]]
    assert tok.encode("hello<|im_end|>") == [ids["hello"], ids["<|im_end|>"]]
    assert tok.encode("hello", add_special_tokens=True) == [ids["[BOS]"], ids["hello"]]
    assert tok.bos_token_id == ids["[BOS]"]
    assert tok.eos_token_ids == [ids["[EOS]"], ids["<|im_end|>"]]
    assert tok.decode([n + 10]) == f"<|reserved_token_{n + 10}|>"
    assert tok.token_to_id(f"<|reserved_token_{n + 255}|>") == n + 255
    assert tok.decode([n + 256, 10**9]) == ""  # out-of-vocab ids decode to nothing
    for text in [MIXED_TEXT, "中文English混合 1234567 it's OK\r\n"]:
        assert tok.decode(tok.encode(text)) == text
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in tok.encode(MIXED_TEXT)] + [stream.flush()]
    assert "".join(pieces) == MIXED_TEXT and not any("\ufffd" in p for p in pieces)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == "<|im_user|>hello<|im_end|>"
    assert tok.encode(prompt) == [ids["<|im_user|>"], ids["hello"], ids["<|im_end|>"]]


def test_kimi_pattern_splits_han_runs(tmp_path: Path) -> None:
    import tiktoken

    enc = tiktoken.Encoding("t", pat_str=KIMI_PAT_STR, mergeable_ranks={bytes([b]): b for b in range(256)},
                            special_tokens={})
    pieces = [enc.decode_single_token_bytes(t) for t in enc.encode("中文English")]
    assert b"".join(pieces).decode() == "中文English"
    # pre-tokenisation is observable through which merges can apply: "文E" never merges across the Han boundary
    ranks = {bytes([b]): b for b in range(256)}
    ranks["文".encode()[-1:] + b"E"] = 256
    enc = tiktoken.Encoding("t2", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    assert 256 not in enc.encode("中文English")


def test_malformed_tiktoken_model(tmp_path: Path) -> None:
    _write_kimi_dir(tmp_path / "kimi")
    (tmp_path / "kimi" / "tiktoken.model").write_text("aGVsbG8= 0\nnot-base64!! 1\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model:2"):
        Tokenizer.load(tmp_path / "kimi")
    (tmp_path / "kimi" / "tiktoken.model").write_text("aGVsbG8= 0\naGk= 2\n")
    with pytest.raises(TokenizerError, match="no gaps or repeats"):
        Tokenizer.load(tmp_path / "kimi")


def test_train_rejects_tiny_vocab(tmp_path: Path) -> None:
    with pytest.raises(MoestreamError, match="vocab_size 100 is too small"):
        train_bpe_tokenizer(["abc"], vocab_size=100, out_dir=tmp_path)


def test_model_dir_python_files_are_never_executed(tmp_path: Path, bpe_dir: Path) -> None:
    marker = tmp_path / "EXECUTED"
    evil = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pwned')\n"
    hf_dir = tmp_path / "hf"
    shutil.copytree(bpe_dir, hf_dir)
    _write_kimi_dir(tmp_path / "kimi")
    for d in (hf_dir, tmp_path / "kimi"):
        for name in ("tokenization_evil.py", "tokenization_kimi.py", "__init__.py"):
            (d / name).write_text(evil)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["tokenizer_class"] = "EvilTokenizer"
        cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        tok = Tokenizer.load(d)
        assert tok.decode(tok.encode("hello")) == "hello"
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert not marker.exists()
    assert not any(name.startswith("tokenization_") for name in sys.modules)


def test_missing_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="expected tokenizer.json or tiktoken.model") as info:
        Tokenizer.load(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert isinstance(info.value, MoestreamError)
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.load(tmp_path / "nope")


def test_malformed_files(bpe_copy: Path) -> None:
    (bpe_copy / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json is malformed"):
        Tokenizer.load(bpe_copy)
    shutil.copy(bpe_copy / "tokenizer_config.json", bpe_copy / "ok.json")
    (bpe_copy / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.load(bpe_copy)


def test_matches_transformers_reference(bpe_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    tok = Tokenizer.load(bpe_dir)
    messages = [{"role": "user", "content": "Hi 你好"}, {"role": "assistant", "content": "ok"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)
    assert tok.encode(MIXED_TEXT) == ref.encode(MIXED_TEXT, add_special_tokens=False)
