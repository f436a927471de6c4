"""Prompt templates for FEVER: built-ins, your own, and their errors."""

from __future__ import annotations

import json
import re

import pytest

from dask_pcm.apps.fever import (
    BUILTIN_TEMPLATES,
    LABELS,
    VERBALISATIONS,
    PromptTemplate,
    get_templates,
    read_templates,
)
from dask_pcm.apps.fever.errors import FeverFormatError

CLAIM = "The Danube flows through Vienna."


def test_builtins_are_many_and_distinct():
    assert len(BUILTIN_TEMPLATES) >= 8
    assert len({t.name for t in BUILTIN_TEMPLATES}) == len(BUILTIN_TEMPLATES)
    assert len({(t.text, t.chat) for t in BUILTIN_TEMPLATES}) == len(BUILTIN_TEMPLATES)
    assert sum(t.chat for t in BUILTIN_TEMPLATES) >= 3
    assert sum(t.text.count("Claim:") >= 4 for t in BUILTIN_TEMPLATES) >= 2  # few-shot
    assert all(t.description for t in BUILTIN_TEMPLATES)


@pytest.mark.parametrize("template", BUILTIN_TEMPLATES, ids=lambda t: t.name)
def test_builtin_renders_and_asks_for_its_answers(template):
    text = template.render(CLAIM)
    assert "{claim}" not in text
    assert text.count(CLAIM) == 1
    assert text == text.rstrip()  # the answer comes next
    if not template.chat:
        assert text.endswith((":", " is", " It is"))
    for label, answer in zip(LABELS, template.answers, strict=True):
        assert answer in VERBALISATIONS[label]
        assert answer in template.text
        assert template.answer_for(label) == answer


def test_verbalisations_cover_labels_without_overlap():
    assert list(VERBALISATIONS) == list(LABELS)
    words = [w for ws in VERBALISATIONS.values() for w in ws]
    assert len(words) == len(set(words))


def test_render_leaves_other_braces_alone():
    template = PromptTemplate("braces", 'JSON {"verdict": ?} for {claim} {0} {other}')
    assert template.render("x {claim} y") == 'JSON {"verdict": ?} for x {claim} y {0} {other}'


def test_chat_template_without_a_chat_tokenizer_is_plain():
    template = get_templates("chat-direct")[0]
    assert template.render(CLAIM) == template.text.replace("{claim}", CLAIM)

    class NoChat:
        chat_template = None

    assert template.render(CLAIM, NoChat()) == template.text.replace("{claim}", CLAIM)


def test_chat_rendering_uses_the_tokenizer(tiny_model_dir):
    from dask_pcm import CausalLM

    tokenizer = CausalLM()(str(tiny_model_dir)).tokenizer
    assert tokenizer.chat_template
    template = get_templates("chat-direct")[0]
    plain = template.text.replace("{claim}", CLAIM)
    rendered = template.render(CLAIM, tokenizer)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": plain}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == expected
    assert plain in rendered
    assert rendered != plain
    # A template that is not a chat template ignores the tokenizer's chat template.
    assert get_templates("direct")[0].render(CLAIM, tokenizer).startswith("Is the following")


def test_default_is_every_builtin():
    assert get_templates() == list(BUILTIN_TEMPLATES)
    assert get_templates(num=3) == list(BUILTIN_TEMPLATES[:3])


def test_names_as_a_comma_separated_string():
    assert [t.name for t in get_templates("direct, fact-checker,one-word")] == [
        "direct",
        "fact-checker",
        "one-word",
    ]
    assert [t.name for t in get_templates("direct,fact-checker,one-word", num=2)] == [
        "direct",
        "fact-checker",
    ]


def test_a_list_of_names_objects_and_strings():
    mine = PromptTemplate(
        "mine", "Claim: {claim}\nYes, No or Maybe? Answer:", answers=("Yes", "No", "Maybe")
    )
    templates = get_templates(
        ["direct", mine, "Claim: {claim}\nAnswer:", "Is {claim} true? Answer:"]
    )
    assert [t.name for t in templates] == ["direct", "mine", "custom-1", "custom-2"]
    assert templates[2].render("A") == "Claim: A\nAnswer:"
    assert templates[2].answers == ("True", "False", "Unknown")
    assert get_templates(("one-word",))[0].name == "one-word"


def test_a_single_template_string_or_object():
    [template] = get_templates("Claim: {claim}\nTrue, False or Unknown:")
    assert template.name == "custom-1"
    assert get_templates(BUILTIN_TEMPLATES[1]) == [BUILTIN_TEMPLATES[1]]


def test_text_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(
        "# name: first\n"
        "Claim: {claim}\n"
        "Answer:\n"
        "---\n"
        "\n"
        "Is {claim} right? {braces} stay.\n"
        "Answer:\n"
        "  ---  \n"
        "# name: talk\n"
        "# chat: true\n"
        "# answers: Yes, No, Maybe\n"
        "# description: a chat one\n"
        "Is it so that {claim}? Yes, No or Maybe.\n"
        "---\n",
        encoding="utf-8",
    )
    first, second, third = get_templates(path)
    assert first == PromptTemplate("first", "Claim: {claim}\nAnswer:")
    assert second.name == "prompts-2"
    assert second.render("x") == "Is x right? {braces} stay.\nAnswer:"
    assert third == PromptTemplate(
        "talk",
        "Is it so that {claim}? Yes, No or Maybe.",
        chat=True,
        description="a chat one",
        answers=("Yes", "No", "Maybe"),
    )
    # The path may also be given as a string, alone or in a list, and with num.
    assert get_templates(str(path), num=1) == [first]
    assert get_templates(["direct", str(path)])[1] == first


def test_text_file_with_bom_and_crlf(tmp_path):
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"\xef\xbb\xbf# name: a\r\nClaim: {claim}\r\nAnswer:\r\n---\r\nB {claim}:\r\n")
    a, b = read_templates(path)
    assert a == PromptTemplate("a", "Claim: {claim}\nAnswer:")
    assert b.text == "B {claim}:"


def test_json_file(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(
        json.dumps(
            [
                {"name": "j1", "text": "Claim: {claim}\nAnswer:"},
                {
                    "name": "j2",
                    "text": "Verdict on {claim}?",
                    "chat": True,
                    "answers": ["Supported", "Refuted", "Not enough info"],
                    "description": "from JSON",
                },
            ]
        ),
        encoding="utf-8",
    )
    j1, j2 = get_templates(path)
    assert j1 == PromptTemplate("j1", "Claim: {claim}\nAnswer:")
    assert j2.chat and j2.answers == ("Supported", "Refuted", "Not enough info")
    assert j2.description == "from JSON"


def test_unknown_builtin_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown template 'nope'; known templates: direct, "):
        get_templates("direct,nope")
    with pytest.raises(ValueError, match=r"unknown template 'nope'.*fact-checker"):
        get_templates(["nope"])
    with pytest.raises(ValueError, match=r"no template names"):
        get_templates(" , ")


def test_template_without_claim():
    with pytest.raises(ValueError, match=r"template 'bad' has no \{claim\}; it needs \{claim\}"):
        PromptTemplate("bad", "Is it true?")
    with pytest.raises(ValueError, match=r"template 'custom-1' has no \{claim\}"):
        get_templates(["Is this claim true? Answer:"])


def test_bad_answers():
    with pytest.raises(ValueError, match=r"answers must be three words"):
        PromptTemplate("a", "{claim}", answers=("Yes", "No"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"answers must be three words"):
        PromptTemplate("a", "{claim}", answers="YNM")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"answers must differ"):
        PromptTemplate("a", "{claim}", answers=("Yes", "Yes", "Maybe"))


def test_duplicate_names():
    with pytest.raises(ValueError, match=r"duplicate template name 'direct'"):
        get_templates("direct,direct")
    with pytest.raises(ValueError, match=r"duplicate template name 'one-word'"):
        get_templates(["one-word", PromptTemplate("one-word", "{claim}:")])


@pytest.mark.parametrize("num", [0, -1])
def test_num_below_one(num):
    with pytest.raises(ValueError, match=r"num must be at least 1"):
        get_templates(num=num)


@pytest.mark.parametrize("content", ["", "\n\n", "---\n\n---\n"])
def test_empty_template_file(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(FeverFormatError, match=rf"^{re.escape(str(path))}: no templates"):
        get_templates(path)


def test_empty_json_file(tmp_path):
    for content in ("", "[]"):
        path = tmp_path / "empty.json"
        path.write_text(content, encoding="utf-8")
        with pytest.raises(FeverFormatError, match=r"empty.json: no templates"):
            get_templates(path)


def test_missing_template_file(tmp_path):
    path = tmp_path / "gone.txt"
    with pytest.raises(FeverFormatError, match=rf"^{re.escape(str(path))}: cannot read"):
        get_templates(str(path))


def test_text_file_template_without_claim_names_file_and_number(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("A {claim}:\n---\n# name: second\nNo placeholder here:\n", encoding="utf-8")
    with pytest.raises(
        FeverFormatError,
        match=rf"^{re.escape(str(path))}: template 2: template 'second' has no \{{claim\}}",
    ):
        get_templates(path)


def test_text_file_template_with_only_headers(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("A {claim}:\n---\n# name: hollow\n", encoding="utf-8")
    with pytest.raises(FeverFormatError, match=r"prompts.txt: template 2 \('hollow'\) is empty"):
        get_templates(path)


@pytest.mark.parametrize(
    "content, message",
    [
        ("[{", r"prompts.json:1: invalid JSON"),
        ('{"name": "a"}', r"prompts.json: expected a JSON list"),
        (
            '[{"name": "a", "text": "{claim}"}, 3]',
            r"prompts.json: template 2: expected a JSON object",
        ),
        ('[{"text": "{claim}"}]', r"prompts.json: template 1: missing name"),
        ('[{"name": "a"}]', r"prompts.json: template 1: missing text"),
        ('[{"name": "a", "text": "no"}]', r"prompts.json: template 1: .*needs \{claim\}"),
        ('[{"name": "a", "text": 5}]', r"prompts.json: template 1: text must be a string"),
        ('[{"name": "a", "text": "{claim}", "chat": "yes"}]', r"template 1: chat must be true"),
        ('[{"name": "a", "text": "{claim}", "answers": ["A"]}]', r"template 1: .*three words"),
        ('[{"name": "a", "text": "{claim}", "style": 1}]', r"template 1: unknown key\(s\)"),
    ],
)
def test_malformed_json_file(tmp_path, content, message):
    path = tmp_path / "prompts.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(FeverFormatError, match=message):
        get_templates(path)
