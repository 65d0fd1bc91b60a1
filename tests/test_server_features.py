"""Server features for evaluation and extraction, through the official `openai` client on a real loopback server:
echo + logprobs (prompt scoring against Engine.logits), n > 1 from one prefill, logit_bias, response_format
(llguidance grammars, validated with jsonschema), and tools / reasoning in the Qwen3 and Kimi formats (a forced
tool_choice makes the random model call a tool). The tool-call parsers also get direct tests on text.
"""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from moestream.server.app import ServerConfig  # noqa: E402
from moestream.server.options import Extras  # noqa: E402
from moestream.server.tools import DEEPSEEK, KIMI, QWEN3, OutputParser  # noqa: E402

from conftest import prompt_ids, save_reference  # noqa: E402
from test_server import LiveServer  # noqa: E402

VOCAB = 512
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # ordinary added tokens, as in Qwen3
KIMI_MARKERS = list(KIMI.markers)  # special tokens, as in Kimi K2
# A DeepSeek-R1-like template: the generation prompt opens <think>; tools render as in Qwen3.
QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}{% for message in messages %}{% if message.tool_calls %}<|im_start|>assistant
{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""
KIMI_TEMPLATE = """{%- if tools %}<|im_start|>tool_declare
{{ tools | tojson }}<|im_end|>
{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}{% if message.tool_calls %}<|tool_calls_section_begin|>{% for tc in message.tool_calls %}\
<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>{{ tc.function.arguments }}<|tool_call_end|>\
{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def build_model(path, template: str) -> None:
    """A tiny random qwen3_moe whose tokenizer has the reasoning / tool-call markers as single tokens."""
    import tokenizers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moestream.bpe import default_training_text, train_bpe_tokenizer

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096, initializer_range=0.2,
                         tie_word_embeddings=False)
    save_reference(Qwen3MoeForCausalLM, cfg, path)
    train_bpe_tokenizer([default_training_text(200_000)], VOCAB - len(MARKERS) - len(KIMI_MARKERS), path)
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens(MARKERS)
    tok.add_special_tokens(KIMI_MARKERS)
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(template, encoding="utf-8")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("feat_model")
    build_model(path, QWEN_TEMPLATE)
    s = LiveServer(ServerConfig(str(path), max_batch=8, prefix_cache="16MiB", prefill_chunk=32))
    yield s
    s.close()


@pytest.fixture(scope="module")
def kimi_server(server, tmp_path_factory):
    path = tmp_path_factory.mktemp("feat_kimi")
    shutil.copytree(server.state.cfg.model, path, dirs_exist_ok=True)
    (path / "chat_template.jinja").write_text(KIMI_TEMPLATE, encoding="utf-8")
    s = LiveServer(ServerConfig(str(path), max_batch=4, prefix_cache=0))
    yield s
    s.close()


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


# ---- echo + logprobs: prompt scoring -------------------------------------------------------------------------
def _engine_prompt_logprobs(server, ids):
    from moestream import Engine

    eng = Engine.open(server.state.cfg.model)
    try:
        return eng.logits(ids).log_softmax(-1)
    finally:
        eng.close()


def _check_scores(server, ids, lp, want, top):
    tok = server.state.tokenizer
    assert lp["tokens"] == [tok.decode([i]) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert lp["token_logprobs"][j] == pytest.approx(float(want[j - 1, ids[j]]), abs=1e-4)
        best = want[j - 1].topk(top).values.tolist()
        got = lp["top_logprobs"][j]  # a dict by token text: alternatives that decode alike (partial UTF-8) merge
        assert max(got.values()) == pytest.approx(best[0], abs=1e-4) and len(got) <= top
        assert all(min(abs(v - b) for b in best) < 1e-4 for v in got.values())
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])


@pytest.mark.parametrize("as_text", [False, True])
def test_echo_scores_prompt_against_engine_logits(server, as_text):
    tok = server.state.tokenizer
    ids = prompt_ids(VOCAB - 16, 70, seed=5)  # longer than prefill_chunk: scored across chunk boundaries
    prompt = tok.decode(ids) if as_text else ids
    if as_text:
        ids = tok.encode(prompt)
    want = _engine_prompt_logprobs(server, ids)
    body = {"model": server.model, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0}
    for _ in range(2):  # the second time a saved prefix exists: scoring must not reuse it (it holds no logits)
        r = _post(server, "/v1/completions", body).json()
        choice = r["choices"][0]
        assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
        assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 0
        _check_scores(server, ids, choice["logprobs"], want, 2)


def test_echo_with_completion_and_stream(server):
    ids = prompt_ids(VOCAB - 16, 12, seed=6)
    c = server.client()
    full = c.completions.create(model=server.model, prompt=ids, echo=True, logprobs=1, max_tokens=4, temperature=0)
    plain = c.completions.create(model=server.model, prompt=ids, logprobs=1, max_tokens=4, temperature=0)
    text = full.choices[0].text
    assert text == server.state.tokenizer.decode(ids) + plain.choices[0].text
    lp = full.choices[0].logprobs
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert len(lp.tokens) == len(ids) + full.usage.completion_tokens
    chunks = list(c.completions.create(model=server.model, prompt=ids, echo=True, logprobs=1, max_tokens=4,
                                       temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text
    streamed = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    offsets = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_loglikelihood_as_lm_evaluation_harness_asks_for_it(server):
    """lm-evaluation-harness's local-completions model sends [[context + continuation ids]] with echo, logprobs 1,
    max_tokens 1 and temperature 0, then sums token_logprobs[ctxlen:-1] (the -1 drops the generated token) and
    calls the continuation greedy when each of its logprobs is the top one. That must equal Engine.logits, also
    when the one generated token is the end-of-sequence token (forced here with logit_bias)."""
    ctx, cont = prompt_ids(VOCAB - 16, 9, seed=9), prompt_ids(VOCAB - 16, 3, seed=10)
    want = _engine_prompt_logprobs(server, ctx + cont)
    expected = sum(float(want[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
    greedy = all(int(want[len(ctx) - 1 + j].argmax()) == t for j, t in enumerate(cont))
    eos = server.state.tokenizer.eos_token_ids[0]
    for bias in ({}, {str(eos): 100}):
        body = {"model": server.model, "prompt": [ctx + cont], "temperature": 0, "max_tokens": 1, "logprobs": 1,
                "seed": 1234, "echo": True, "logit_bias": bias}
        choice = _post(server, "/v1/completions", body).json()["choices"][0]
        lps, tops = choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]
        assert len(lps) == len(ctx) + len(cont) + 1
        assert sum(lps[len(ctx):-1]) == pytest.approx(expected, abs=1e-4)
        assert all(lp == max(top.values()) for lp, top in zip(lps[len(ctx):-1], tops[len(ctx):-1])) == greedy
    assert choice["finish_reason"] == "stop"


def test_max_tokens_zero_needs_echo(server):
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": "a", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# ---- n > 1 ----------------------------------------------------------------------------------------------------
def test_n_choices_share_prefill_and_have_their_own_seeded_streams(server):
    c = server.client()
    ids = prompt_ids(VOCAB - 16, 20, seed=7)
    before = server.state.scheduler.counters["prompt_tokens"]
    many = c.completions.create(model=server.model, prompt=ids, n=3, max_tokens=8, temperature=1.0, seed=11)
    assert server.state.scheduler.counters["prompt_tokens"] - before == len(ids)  # one prefill for three choices
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert many.usage.prompt_tokens == len(ids)
    singles = [c.completions.create(model=server.model, prompt=ids, max_tokens=8, temperature=1.0, seed=11 + i)
               for i in range(3)]
    assert [ch.text for ch in many.choices] == [s.choices[0].text for s in singles]
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert len({ch.text for ch in many.choices}) > 1


def test_n_chat_streamed_equals_non_streamed(server):
    c = server.client()
    kw = dict(model=server.model, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6, temperature=0.8,
              seed=3)
    full = c.chat.completions.create(**kw)
    texts = {0: "", 1: ""}
    finishes = {}
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += getattr(choice.delta, "reasoning_content", None) or ""
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    for choice in full.choices:  # this template opens <think>: the output is reasoning
        assert texts[choice.index] == (choice.message.content or "") + choice.message.reasoning_content
        assert finishes[choice.index] == choice.finish_reason


# ---- logit_bias and response_format -------------------------------------------------------------------------
def test_logit_bias_forces_and_bans_tokens(server):
    c = server.client()
    ids = prompt_ids(VOCAB - 16, 10, seed=8)
    forced = c.completions.create(model=server.model, prompt=ids, max_tokens=5, temperature=0,
                                  logit_bias={"300": 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [server.state.tokenizer.decode([300])] * 5
    greedy = c.completions.create(model=server.model, prompt=ids, max_tokens=1, temperature=0)
    first = server.state.tokenizer.encode(greedy.choices[0].text)[0]
    banned = c.completions.create(model=server.model, prompt=ids, max_tokens=1, temperature=0,
                                  logit_bias={str(first): -100})
    assert banned.choices[0].text != greedy.choices[0].text
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": ids, "logit_bias": {"99999": 1}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(server, stream):
    c = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        kw = dict(model=server.model, messages=[{"role": "user", "content": "a person"}], max_tokens=200,
                  temperature=1.0, seed=seed, response_format=fmt)
        if stream:
            chunks = list(c.chat.completions.create(stream=True, **kw))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        else:
            r = c.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        jsonschema.validate(json.loads(text), PERSON)
        assert finish == "stop"


def test_json_object_on_completions(server):
    """Every output the grammar completes is a JSON object. The random model wanders through long strings, so at
    temperature 0.7 only some seeds close the object within 300 tokens (3 of these 8 with engine.sampling.draw);
    a cut one must still be a prefix the grammar allowed, i.e. start the object."""
    stopped = 0
    for seed in range(1, 9):
        r = server.client().completions.create(model=server.model, prompt="data:", max_tokens=300, temperature=0.7,
                                               seed=seed, extra_body={"response_format": {"type": "json_object"}})
        text, finish = r.choices[0].text, r.choices[0].finish_reason
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
            stopped += 1
        else:
            assert finish == "length" and text.lstrip().startswith("{")
    assert stopped >= 1


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema"),
    ({"type": "yaml"}, "response_format")])
def test_invalid_response_format_is_400(server, fmt, param):
    r = _post(server, "/v1/chat/completions", {"model": server.model, "messages": [{"role": "user", "content": "a"}],
                                               "response_format": fmt})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


# ---- tools and reasoning --------------------------------------------------------------------------------------
def _stream_tool_calls(chunks):
    calls, finish = {}, None
    for ch in chunks:
        for choice in ch.choices:
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("which", ["qwen3", "kimi"])
def test_forced_tool_call_parsed_streamed_and_not(server, kimi_server, which):
    srv = server if which == "qwen3" else kimi_server
    c = srv.client()
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kw = dict(model=srv.model, messages=msgs, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=120,
                  temperature=1.0, seed=4, parallel_tool_calls=False)
        r = c.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and not msg.content and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        spec = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
        if which == "kimi":
            assert call.id == f"functions.{call.function.name}:{call.id.rsplit(':', 1)[1]}"
        calls, finish = _stream_tool_calls(c.chat.completions.create(stream=True, **kw))
        assert finish == "tool_calls"
        assert [(x["name"], json.loads(x["arguments"])) for x in calls] == \
            [(call.function.name, json.loads(call.function.arguments))]
        # the call goes back into the conversation through the template
        follow = msgs + [msg.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        again = c.chat.completions.create(model=srv.model, messages=follow, tools=[WEATHER, CLOCK], max_tokens=3,
                                          temperature=0)
        assert again.choices[0].finish_reason in ("stop", "length")


def test_reasoning_split_matches_raw_text(server):
    """The template opens <think>; with </think> made likely by logit_bias, the chat answer's reasoning_content and
    content are the raw completion split at </think>, streamed or not."""
    c, tok = server.client(), server.state.tokenizer
    msgs = [{"role": "user", "content": "think"}]
    prompt = tok.encode(tok.apply_chat_template(msgs))
    close = str(tok.token_to_id("</think>"))
    for seed in range(30):
        kw = dict(max_tokens=12, temperature=1.0, seed=seed, logit_bias={close: 3})
        raw = c.completions.create(model=server.model, prompt=prompt, **kw).choices[0].text
        if "</think>" in raw[1:]:
            break
    else:
        pytest.fail("no sample closed the reasoning")
    thought, _, answer = raw.partition("</think>")
    r = c.chat.completions.create(model=server.model, messages=msgs, **kw)
    assert r.choices[0].message.reasoning_content == thought
    assert r.choices[0].message.content == answer.lstrip("\n")
    parts = {"reasoning_content": "", "content": ""}
    for ch in c.chat.completions.create(model=server.model, messages=msgs, stream=True, **kw):
        for key in parts:
            parts[key] += getattr(ch.choices[0].delta, key, None) or ""
    assert parts == {"reasoning_content": thought, "content": answer.lstrip("\n")}


def test_tools_errors(server, kimi_server):
    base = {"model": server.model, "messages": [{"role": "user", "content": "a"}]}
    bad = [({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
           ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
            "tools[0].function.parameters"),
           ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format")]
    for extra, param in bad:
        r = _post(server, "/v1/chat/completions", base | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


# ---- the parsers on text -------------------------------------------------------------------------------------
def _parse(text: str, fmt: str | None, reasoning: bool = False, opened: bool = False, step: int = 0):
    p = OutputParser(Extras(tool_format=fmt, reasoning=reasoning, reasoning_open=opened))
    pieces = [text] if not step else [text[i:i + step] for i in range(0, len(text), step)]
    events = [e for piece in pieces for e in p.feed(piece)] + p.flush()
    out = {"content": "", "reasoning": "", "calls": []}
    for kind, v in events:
        if kind == "tool_call":
            out["calls"].append((v.index, v.id if fmt == "kimi" else None, v.name, json.loads(v.arguments)))
        else:
            out[kind] += v
    return out


CASES = {
    "kimi": ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
             '<|tool_call_argument_begin|>{"zone": 2}<|tool_call_end|><|tool_calls_section_end|>'),
    "deepseek": ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": 2}'
                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "qwen3": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>'),
}


@pytest.mark.parametrize("fmt", ["kimi", "deepseek", "qwen3"])
@pytest.mark.parametrize("step", [0, 1, 3])
def test_parsers_each_format(fmt, step):
    got = _parse(CASES[fmt], fmt, step=step)
    ids = ["functions.get_weather:0", "functions.get_time:1"] if fmt == "kimi" else [None, None]
    assert got["calls"] == [(0, ids[0], "get_weather", {"city": "Paris"}), (1, ids[1], "get_time", {"zone": 2})]
    assert got["content"].strip() == "Let me check." and got["reasoning"] == ""


def test_parser_edge_cases():
    assert _parse("no calls < here <tool", "qwen3", step=1)["content"] == "no calls < here <tool"
    broken = '<tool_call>\n{"name": oops}\n</tool_call>'
    assert _parse(broken, "qwen3") == {"content": broken, "reasoning": "", "calls": []}
    cut = '<tool_call>\n{"name": "f", "argu'  # max_tokens ended inside a call: it stays text
    assert _parse(cut, "qwen3", step=2)["content"] == cut
    text = "<think>\nhmm, a plan</think>\n\nThe answer."
    for step in (0, 1, 4):
        assert _parse(text, None, reasoning=True, step=step) == {"content": "The answer.",
                                                                 "reasoning": "\nhmm, a plan", "calls": []}
    assert _parse("plain answer", None, reasoning=True, step=1)["content"] == "plain answer"
    assert _parse("opened</think>done", None, reasoning=True, opened=True, step=2) == \
        {"content": "done", "reasoning": "opened", "calls": []}
    both = 'ok</think><tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    got = _parse(both, "qwen3", reasoning=True, opened=True, step=1)
    assert got["reasoning"] == "ok" and got["calls"] == [(0, None, "f", {})]
    for fmt in (KIMI, DEEPSEEK, QWEN3):
        assert _parse("just text", fmt.name)["content"] == "just text"


@pytest.mark.parametrize("fmt", [KIMI, DEEPSEEK, QWEN3])
def test_forced_call_grammar_accepts_the_format_and_its_parser_reads_it(server, fmt):
    """Each format's forced-call grammar admits a call written in that format (arguments checked against the
    schema), and the parser turns that text back into the call."""
    import llguidance

    from moestream.server.tools import forced_call_grammar

    tok = server.state.tokenizer
    grammar = forced_call_grammar(fmt, [WEATHER, CLOCK], "get_time", False, tok)
    lltok = server.state.scheduler.guides.lltokenizer()
    texts = {"kimi": '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>'
                     '{"zone":{z}}<|tool_call_end|><|tool_calls_section_end|>',
             "deepseek": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
                         '{"zone":{z}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
             "qwen3": '<tool_call>\n{"name":"get_time","arguments":{"zone":{z}}}\n</tool_call>'}
    for zone, ok in ((3, True), (99, False)):  # 99 breaks the schema's maximum
        text = texts[fmt.name].replace("{z}", str(zone))
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        accepted = m.consume_tokens(tok.encode(text)) and m.is_accepting()
        assert accepted == ok, (fmt.name, zone, m.get_error())
    assert _parse(texts[fmt.name].replace("{z}", "3"), fmt.name)["calls"][0][2:] == ("get_time", {"zone": 3})


def test_guide_on_a_tiktoken_tokenizer(tmp_path):
    """Kimi checkpoints ship a tiktoken vocabulary: the grammar guide builds on it too, and sampling under its mask
    from arbitrary logits ends in JSON that validates; logit_bias is added before the mask."""
    import torch

    from moestream.server.structured import GuideFactory, json_grammar
    from moestream.tokenizer import Tokenizer
    from test_tokenizer import _write_kimi_dir

    ids = _write_kimi_dir(tmp_path / "kimi")
    tok = Tokenizer.load(tmp_path / "kimi")
    vocab = ids["n_base"] + 256
    schema = {"type": "object", "properties": {"w": {"enum": ["hello", "你好"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 99}}, "required": ["w", "n"], "additionalProperties": False}
    factory = GuideFactory(tok, vocab, tok.eos_token_ids)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        guide = factory.guide(json_grammar(schema, "s"), {ids["hello"]: 5.0})
        out = []
        while not guide.done and len(out) < 60:
            logits = torch.randn(vocab, generator=gen)
            shaped = guide.apply(logits)
            assert shaped[ids["hello"]] == logits[ids["hello"]] + 5 or shaped[ids["hello"]] == float("-inf")
            tok_id = int(torch.multinomial(shaped.softmax(-1), 1, generator=gen))
            if tok_id in tok.eos_token_ids:
                break
            guide.accept(tok_id)
            out.append(tok_id)
        jsonschema.validate(json.loads(tok.decode(out)), schema)


def test_choices_free_their_state_when_done_or_cancelled(kimi_server):
    """Forked choices hold cloned state: finished, failed or cancelled, every byte goes back (no prefix cache
    here, so nothing may stay)."""
    import time

    srv = kimi_server
    c = srv.client()
    ids = prompt_ids(VOCAB - 16, 30, seed=12)
    r = c.completions.create(model=srv.model, prompt=ids, n=4, max_tokens=5, temperature=1.0, seed=2)
    assert len(r.choices) == 4
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json={"model": srv.model, "prompt": ids, "n": 3, "max_tokens": 500, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {") and '"index": 2' in line:
                break  # leave mid-stream: the server cancels all three choices
    r = _post(srv, "/v1/completions", {"model": srv.model, "prompt": ids, "n": 2, "max_tokens": 1,
                                      "logit_bias": {"99999": 1}})
    assert r.status_code == 400
    deadline = time.time() + 10
    while srv.state.engine.memory.state_bytes and time.time() < deadline:
        time.sleep(0.05)
    assert srv.state.engine.memory.state_bytes == 0 and not srv.state.scheduler.active
