"""Action parser, observation format, rewards (EM, MCQ) and prompts."""

import random
import re
import time

import pytest

from stppo.envs.actions import (INVALID_ACTION_OBSERVATION, doc_from_contents, format_information,
                                parse_action)
from stppo.envs.base import Doc, Question
from stppo.envs.prompts import INSTRUCT_SYSTEM, build_prompt
from stppo.envs.rewards import em_score, mcq_score, normalize_answer, option_letter

SEARCH_R1_PATTERN = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)  # generation.py


def _reference(text):
    m = SEARCH_R1_PATTERN.search(text)
    return (m.group(1), m.group(2).strip()) if m else ("invalid", "")


@pytest.mark.parametrize("text,expected", [
    ("<search> Elara Voss born</search>", ("search", "Elara Voss born")),
    ("<think>need the city</think>\n<search>x y</search>", ("search", "x y")),
    ("<answer> Tarnhelm </answer>", ("answer", "Tarnhelm")),
    ("<think>I know</think><answer>a</answer>", ("answer", "a")),
    ("<search>q1</search><answer>a</answer>", ("search", "q1")),  # first complete pair wins
    ("<answer>a</answer><search>q</search>", ("answer", "a")),
    ("<search>unclosed", ("invalid", "")),
    ("<answer>unclosed <search>q</search>", ("search", "q")),  # unclosed answer is skipped
    ("<search>a<search>b</search>", ("search", "a<search>b")),  # nested: first opening tag
    ("<answer>x <search>q</search> y</answer>", ("answer", "x <search>q</search> y")),
    ("<answer></answer>", ("answer", "")),
    ("</search>q<search>", ("invalid", "")),
    ("<Search>q</Search>", ("invalid", "")),
    ("just text", ("invalid", "")),
    ("", ("invalid", "")),
])
def test_parse_action_cases(text, expected):
    assert parse_action(text) == expected
    assert _reference(text) == expected


def test_parse_action_matches_search_r1_regex_on_random_text():
    rng = random.Random(0)
    pieces = ["<search>", "</search>", "<answer>", "</answer>", "<think>", "</think>", "a", " ",
              "\n", "<", ">", "/", "search", "answer"]
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(14)))
        assert parse_action(text) == _reference(text), text


def test_parse_action_adversarial_text_is_fast_and_safe():
    rng = random.Random(1)
    junk = "".join(rng.choice("<>/ab searchanswer\n\x00é") for _ in range(10_000))
    inputs = [junk, "<search>" * 2000, "<answer>" * 1250 + "</search>" * 1000,
              "<search>" + "x" * 10_000, "<" * 10_000, "<answer>" + "<search>" * 1200 + "</answer>",
              ("<search><answer>" * 600) + "</answer>", "\x00" * 10_000]
    start = time.perf_counter()
    for text in inputs * 10:
        kind, content = parse_action(text)
        assert kind in ("search", "answer", "invalid") and isinstance(content, str)
    assert time.perf_counter() - start < 2.0  # linear scans; a backtracking parser takes minutes
    assert parse_action("<answer>" + "<search>" * 1200 + "</answer>")[0] == "answer"
    with pytest.raises(ValueError, match="must be a str"):
        parse_action(None)


def test_information_format_is_search_r1s():
    docs = [Doc("1", "Elara Voss", "Elara Voss was born in Tarnhelm."), Doc("2", "T", "line1\nline2")]
    assert format_information(docs) == (
        '\n\n<information>Doc 1(Title: "Elara Voss") Elara Voss was born in Tarnhelm.\n'
        'Doc 2(Title: "T") line1\nline2</information>\n\n')
    assert format_information([]) == "\n\n<information></information>\n\n"
    assert INVALID_ACTION_OBSERVATION.startswith("\nMy previous action is invalid. If I want to search")
    assert doc_from_contents("7", '"A title"\nsome\ntext') == Doc("7", "A title", "some\ntext")
    assert doc_from_contents("8", "no quotes") == Doc("8", "no quotes", "")


@pytest.mark.parametrize("raw,norm", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  an   apple, a day ", "apple day"),
    ("Theatre", "theatre"),  # articles only as whole words
    ("U.S.A.", "usa"),
    ("Tarnhelm", "tarnhelm"),
])
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_em_score():
    golds = ("Barack Obama", "Obama")
    assert em_score("barack obama.", golds) == 1.0
    assert em_score("The  Obama", golds) == 1.0
    assert em_score("Obama Barack", golds) == 0.0
    assert em_score("Barack Obama Jr", golds) == 0.0
    assert em_score(None, golds) == 0.0
    assert em_score("", ("",)) == 1.0


OPTIONS = {"A": "Aspirin", "B": "Ibuprofen", "C": "Paracetamol", "D": "A beta blocker", "E": "None"}


@pytest.mark.parametrize("answer,letter", [
    ("C", "C"), ("c", "C"), ("(C)", "C"), ("C.", "C"), ("C. Paracetamol", "C"), ("C) whatever", "C"),
    ("C: Paracetamol", "C"), ("C Paracetamol", "C"), ("paracetamol", "C"), ("Paracetamol.", "C"),
    ("a beta blocker", "D"), ("Aspirin", "A"), ("C Ibuprofen", None), ("F", None), ("Cough", None),
    ("", None), (None, None),
])
def test_option_letter(answer, letter):
    assert option_letter(answer, OPTIONS) == letter


def test_mcq_score():
    assert mcq_score("(C)", "C", OPTIONS) == 1.0
    assert mcq_score("Paracetamol", "c", OPTIONS) == 1.0
    assert mcq_score("B", "C", OPTIONS) == 0.0
    assert mcq_score("no idea", "C", OPTIONS) == 0.0


def test_prompt_styles():
    q = Question("q", "who wrote it", ("x",))
    assert build_prompt(q, "compact") == "Question: who wrote it\n"
    p = build_prompt(q, "search_r1")
    assert p.startswith("Answer the given question. You must conduct reasoning inside <think> and "
                        "</think> first every time you get new information.")
    assert "between <information> and </information>." in p
    assert p.endswith("For example, <answer> Beijing </answer>. Question: who wrote it?\n")
    mcq = Question("m", "Which drug?", ("C",), meta={"options": {"A": "x", "B": "y"}})
    assert build_prompt(mcq, "compact") == "Question: Which drug?\nA. x\nB. y\n"
    with pytest.raises(ValueError, match="allowed: search_r1, chat, instruct, compact"):
        build_prompt(q, "fancy")
    for style in ("chat", "instruct"):
        with pytest.raises(ValueError, match=f"prompt_style='{style}' needs a tokenizer with a chat_template"):
            build_prompt(q, style)


def test_chat_prompt_uses_the_tokenizers_template():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, "[UNK]")),
                                  unk_token="[UNK]")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    q = Question("q", "Where was Elara Voss born?", ("x",))
    text = build_prompt(q, "chat", tok)
    assert text == f"<|user|>{build_prompt(q, 'search_r1')}<|end|><|assistant|>"
    # instruct: the short instruction as the system message (a template's default system prompt
    # gives way), the question alone as the user's
    assert build_prompt(q, "instruct", tok) == (f"<|system|>{INSTRUCT_SYSTEM}<|end|><|user|>Question: Where was "
                                                "Elara Voss born?<|end|><|assistant|>")
    assert all(t in INSTRUCT_SYSTEM for t in ("<search> query </search>", "<information>", "<answer> answer </answer>"))
