"""Prompt templates that ask a model to verify a FEVER claim.

A :class:`PromptTemplate` holds a prompt with a ``{claim}`` placeholder and the answer words that
stand for each label. Every built-in template ends where the answer begins, so the model's next
token is the answer; scoring compares the likelihood of each label's word. :func:`get_templates`
picks built-ins by name or reads your own from strings or files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dask_pcm.apps.fever.data import LABELS, unicode_problem
from dask_pcm.apps.fever.errors import FeverFormatError

PLACEHOLDER = "{claim}"

#: Answer words for each label, in :data:`~dask_pcm.apps.fever.data.LABELS` order of keys.
VERBALISATIONS: dict[str, tuple[str, ...]] = {
    "SUPPORTS": ("True", "Supported", "Yes", "Correct"),
    "REFUTES": ("False", "Refuted", "No", "Incorrect"),
    "NOT ENOUGH INFO": ("Unknown", "Not enough info", "Maybe", "Unverifiable"),
}

_DEFAULT_ANSWERS: tuple[str, str, str] = ("True", "False", "Unknown")

_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")


@dataclass(frozen=True)
class PromptTemplate:
    """A prompt that asks for a verdict on one claim.

    Parameters
    ----------
    name
        A short name, unique among the templates of one run.
    text
        The prompt; ``{claim}`` is replaced by the claim. Other braces are left alone.
    chat
        Wrap the prompt as a user turn in the tokenizer's chat template, when it has one.
    description
        One line saying what the template tries.
    answers
        The words that stand for SUPPORTS, REFUTES and NOT ENOUGH INFO, in that order.

    Examples
    --------
    >>> t = PromptTemplate("mine", "Claim: {claim}\\nTrue, False or Unknown? Answer:")
    >>> t.render("Snow is white.")
    'Claim: Snow is white.\\nTrue, False or Unknown? Answer:'
    """

    name: str
    text: str
    chat: bool = False
    description: str = ""
    answers: tuple[str, str, str] = _DEFAULT_ANSWERS

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"template name {self.name!r} is not allowed: use letters, digits, '.', '_' "
                "and '-', not starting with '.' (names become file names in an output folder)"
            )
        if PLACEHOLDER not in self.text:
            raise ValueError(f"template {self.name!r} has no {PLACEHOLDER}; it needs {PLACEHOLDER}")
        answers = () if isinstance(self.answers, str) else tuple(self.answers)
        if len(answers) != 3 or not all(isinstance(a, str) and a.strip() for a in answers):
            raise ValueError(
                f"template {self.name!r}: answers must be three words, for "
                f"{', '.join(LABELS)}; got {self.answers!r}"
            )
        if len(set(answers)) != 3:
            raise ValueError(f"template {self.name!r}: answers must differ, got {answers!r}")
        object.__setattr__(self, "answers", answers)

    def answer_for(self, label: str) -> str:
        """The word that stands for ``label`` in this template."""
        return self.answers[LABELS.index(label)]

    def render(self, claim: str, tokenizer: Any = None) -> str:
        """The prompt for ``claim``, in ``tokenizer``'s chat template when ``chat`` is set.

        Examples
        --------
        >>> get_templates("direct")[0].render("Snow is white.").endswith("Answer:")
        True
        """
        text = self.text.replace(PLACEHOLDER, claim)
        if self.chat and getattr(tokenizer, "chat_template", None):
            return str(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
            )
        return text


_FEW_SHOT_TFU = """\
Decide whether each claim is True, False or Unknown.

Claim: Copper conducts electricity.
Answer: True

Claim: The Atlantic Ocean is smaller than Lake Geneva.
Answer: False

Claim: A fisherman named Oskar caught three trout last Tuesday.
Answer: Unknown

Claim: {claim}
Answer:"""

_FEW_SHOT_VERDICT = """\
Each claim below gets a verdict: Supported, Refuted or Not enough info.

Claim: Rome is in Italy.
Verdict: Supported

Claim: Horses have six legs.
Verdict: Refuted

Claim: The librarian in Dunmore prefers mint tea.
Verdict: Not enough info

Claim: {claim}
Verdict:"""

_VERDICT_ANSWERS: tuple[str, str, str] = ("Supported", "Refuted", "Not enough info")
_YES_NO_ANSWERS: tuple[str, str, str] = ("Yes", "No", "Maybe")

BUILTIN_TEMPLATES: tuple[PromptTemplate, ...] = (
    PromptTemplate(
        "direct",
        "Is the following claim True, False or Unknown?\nClaim: {claim}\nAnswer:",
        description="A direct question with the three answer words.",
    ),
    PromptTemplate(
        "fact-checker",
        "You are a careful fact checker. Judge the claim below using what you know about the "
        "world, and reply with Supported, Refuted or Not enough info.\n\n"
        "Claim: {claim}\nVerdict:",
        description="A fact-checker role with verdict words.",
        answers=_VERDICT_ANSWERS,
    ),
    PromptTemplate(
        "true-false-unknown",
        "Statement: {claim}\nThis statement is True, False, or Unknown. It is",
        description="Completes a sentence with True, False or Unknown.",
    ),
    PromptTemplate(
        "one-word",
        "Answer with a single word: True, False or Unknown.\nClaim: {claim}\nOne-word answer:",
        description="Asks for a one-word answer.",
    ),
    PromptTemplate(
        "yes-no",
        'Question: Is it correct that "{claim}"? Answer Yes, No or Maybe.\nAnswer:',
        description="A yes/no question with Maybe for unverifiable claims.",
        answers=_YES_NO_ANSWERS,
    ),
    PromptTemplate(
        "few-shot",
        _FEW_SHOT_TFU,
        description="Three invented examples, one per label, with True/False/Unknown.",
    ),
    PromptTemplate(
        "few-shot-verdict",
        _FEW_SHOT_VERDICT,
        description="Three invented examples, one per label, with verdict words.",
        answers=_VERDICT_ANSWERS,
    ),
    PromptTemplate(
        "chat-direct",
        "Is this claim true, false or unknown? Reply with exactly one word: True, False or "
        "Unknown.\n\nClaim: {claim}",
        chat=True,
        description="The direct question as a chat turn.",
    ),
    PromptTemplate(
        "chat-fact-checker",
        "Act as a fact checker. Reply with only your verdict: Supported, Refuted or Not enough "
        "info.\n\nClaim: {claim}",
        chat=True,
        description="The fact-checker role as a chat turn.",
        answers=_VERDICT_ANSWERS,
    ),
    PromptTemplate(
        "chat-few-shot",
        _FEW_SHOT_TFU,
        chat=True,
        description="The True/False/Unknown examples as a chat turn.",
    ),
)

_BUILTIN_BY_NAME = {t.name: t for t in BUILTIN_TEMPLATES}
_FILE_SUFFIXES = (".txt", ".json")
_SEPARATOR = "---"
_TEXT_HEADERS = ("name", "chat", "answers", "description")

TemplateItem = str | os.PathLike[str] | PromptTemplate
TemplateSpec = TemplateItem | Sequence[TemplateItem]


def get_templates(spec: TemplateSpec | None = None, num: int | None = None) -> list[PromptTemplate]:
    """The prompt templates named by ``spec``.

    Parameters
    ----------
    spec
        ``None`` for every built-in template; a comma-separated string of built-in names
        (``"direct,fact-checker"``); a template text containing ``{claim}``; the path of a
        template file; a :class:`PromptTemplate`; or a list of any of these. Texts get the
        names ``custom-1``, ``custom-2``...

        A ``.txt`` file holds templates separated by lines of only ``---``; a template may
        start with header lines ``# name: ...``, ``# chat: true``, ``# answers: Yes, No, Maybe``
        and ``# description: ...``. A ``.json`` file holds a list of objects with ``name`` and
        ``text`` and optionally ``chat``, ``answers`` and ``description``.
    num
        Keep only the first ``num`` templates.

    Raises
    ------
    FeverFormatError
        A template file is missing, empty or malformed; the message names the file and the
        template number.
    ValueError
        An unknown built-in name, a template without ``{claim}``, duplicate names, ``num < 1``.

    Examples
    --------
    >>> [t.name for t in get_templates("direct,one-word")]
    ['direct', 'one-word']
    >>> get_templates(["direct", "Claim: {claim}\\nTrue or False? Answer:"])[1].name
    'custom-1'
    """
    if num is not None and num < 1:
        raise ValueError(f"num must be at least 1, not {num!r}")
    if spec is None:
        templates = list(BUILTIN_TEMPLATES)
    elif isinstance(spec, str) and PLACEHOLDER not in spec and not _looks_like_file(spec):
        templates = [_builtin(name.strip()) for name in spec.split(",") if name.strip()]
        if not templates:
            raise ValueError(f"no template names in {spec!r}; known templates: {_known()}")
    else:
        items = [spec] if isinstance(spec, str | os.PathLike | PromptTemplate) else list(spec)
        templates = []
        custom = 0
        for item in items:
            if isinstance(item, PromptTemplate):
                templates.append(item)
            elif isinstance(item, os.PathLike) or _looks_like_file(item):
                templates.extend(read_templates(item))
            elif item in _BUILTIN_BY_NAME:
                templates.append(_BUILTIN_BY_NAME[item])
            elif PLACEHOLDER in item or any(c.isspace() for c in item.strip()):
                custom += 1
                templates.append(PromptTemplate(f"custom-{custom}", item))
            else:
                templates.append(_builtin(item))
    seen: set[str] = set()
    for template in templates:
        if template.name in seen:
            raise ValueError(f"duplicate template name {template.name!r}; names must be unique")
        seen.add(template.name)
    return templates[:num] if num is not None else templates


def read_templates(path: str | os.PathLike[str]) -> list[PromptTemplate]:
    """The templates in a ``.txt`` or ``.json`` file (see :func:`get_templates`).

    Examples
    --------
    >>> read_templates("prompts.txt")  # doctest: +SKIP
    [PromptTemplate(name='prompts-1', text='Claim: {claim}\\nAnswer:', ...)]
    """
    name = str(path)
    try:
        with open(path, encoding="utf-8-sig") as f:
            content = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise FeverFormatError(f"{name}: cannot read templates: {reason}") from e
    if Path(path).suffix.lower() == ".json":
        templates = _from_json(content, name)
    else:
        templates = _from_text(content, name, Path(path).stem)
    if not templates:
        raise FeverFormatError(f"{name}: no templates (the file is empty)")
    return templates


def _from_text(content: str, name: str, stem: str) -> list[PromptTemplate]:
    chunks: list[list[str]] = [[]]
    for line in content.splitlines():
        if line.strip() == _SEPARATOR:
            chunks.append([])
        else:
            chunks[-1].append(line)
    templates = []
    number = 0
    for lines in chunks:
        if not "".join(lines).strip():
            continue  # blank space around separators, or a trailing separator
        number += 1
        fields: dict[str, Any] = {"name": f"{_safe_stem(stem)}-{number}"}
        while lines and lines[0].startswith("#") and ":" in lines[0]:
            key, _, value = lines[0].lstrip("#").partition(":")
            key = key.strip().lower()
            if key not in _TEXT_HEADERS:
                break
            fields[key] = value.strip()
            lines = lines[1:]
        if "chat" in fields:
            fields["chat"] = fields["chat"].lower() in ("true", "yes", "1")
        if "answers" in fields:
            fields["answers"] = tuple(a.strip() for a in fields["answers"].split(","))
        fields["text"] = "\n".join(lines).strip("\n")
        templates.append(_make(fields, name, number))
    return templates


def _from_json(content: str, name: str) -> list[PromptTemplate]:
    try:
        records = json.loads(content) if content.strip() else []
    except json.JSONDecodeError as e:
        raise FeverFormatError(f"{name}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(records, list):
        raise FeverFormatError(f"{name}: expected a JSON list of templates")
    templates = []
    for number, record in enumerate(records, start=1):
        if not isinstance(record, dict):
            raise FeverFormatError(f"{name}: template {number}: expected a JSON object")
        unknown = sorted(set(record) - {"name", "text", "chat", "answers", "description"})
        if unknown:
            raise FeverFormatError(f"{name}: template {number}: unknown key(s) {unknown}")
        missing = [key for key in ("name", "text") if key not in record]
        if missing:
            raise FeverFormatError(f"{name}: template {number}: missing {', '.join(missing)}")
        if not isinstance(record.get("chat", False), bool):
            raise FeverFormatError(f"{name}: template {number}: chat must be true or false")
        fields = dict(record)
        if isinstance(fields.get("answers"), list):
            fields["answers"] = tuple(fields["answers"])
        templates.append(_make(fields, name, number))
    return templates


def _make(fields: dict[str, Any], name: str, number: int) -> PromptTemplate:
    """A template from a file's fields; problems become FeverFormatError naming file and number."""
    for key in ("name", "text", "description"):
        if not isinstance(fields.get(key, ""), str):
            raise FeverFormatError(f"{name}: template {number}: {key} must be a string")
    if not fields["text"].strip():
        raise FeverFormatError(f"{name}: template {number} ({fields['name']!r}) is empty")
    for key in ("name", "text", "description", "answers"):
        value = fields.get(key, "")
        for text in value if isinstance(value, tuple | list) else [value]:
            if problem := unicode_problem(str(text)):
                raise FeverFormatError(f"{name}: template {number}: {key} is {problem}")
    try:
        return PromptTemplate(**fields)
    except ValueError as e:
        raise FeverFormatError(f"{name}: template {number}: {e}") from None


def _safe_stem(stem: str) -> str:
    """A file's stem made a valid template name prefix (``my prompts`` -> ``my_prompts``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem).lstrip(".")[:80] or "templates"


def _looks_like_file(item: str) -> bool:
    return item.lower().endswith(_FILE_SUFFIXES) or (
        os.sep in item and "," not in item and os.path.exists(item)
    )


def _builtin(name: str) -> PromptTemplate:
    try:
        return _BUILTIN_BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown template {name!r}; known templates: {_known()} "
            f"(a template of your own must contain {PLACEHOLDER})"
        ) from None


def _known() -> str:
    return ", ".join(_BUILTIN_BY_NAME)
