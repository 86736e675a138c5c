"""accuracy.py's task set: cloze items drawn with a fixed seed from English prose on this machine,
written once to a JSON file and reused, so that later runs (and other machines given the file)
score the very same items.

Documents: each file of /usr/share/common-licenses (each text once, links followed) and the
docstrings of the modules in STDLIB and of their public classes and functions, cut into
paragraphs; only paragraphs that read as prose are kept (no code, doctest or table lines).
"""

from __future__ import annotations

import glob
import importlib
import inspect
import json
import os
import random
import re

LICENSES = "/usr/share/common-licenses"
STDLIB = ("abc", "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
          "datetime", "decimal", "email", "enum", "fractions", "functools", "heapq", "http.client", "imaplib",
          "inspect", "io", "ipaddress", "itertools", "json", "logging", "mailbox", "multiprocessing", "optparse",
          "os", "pathlib", "pickle", "queue", "random", "re", "shutil", "smtplib", "socket", "statistics",
          "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest",
          "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom", "zipfile")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
WORD = re.compile(r"^[A-Za-z]{4,}$")
ITEMS = 400  # per task, drawn in this order: a run takes the first ones it needs
GREEDY = 128
CONTEXT_WORDS = 48
GREEDY_WORDS = 40


def license_texts() -> list[str]:
    seen, texts = set(), []
    for path in sorted(glob.glob(os.path.join(LICENSES, "*"))):
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(real):
            continue
        seen.add(real)
        with open(real, errors="replace") as f:
            texts.append(f.read())
    return texts


def docstring_texts() -> list[str]:
    texts = []
    for name in STDLIB:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        docs = [module.__doc__ or ""]
        for attr in sorted(dir(module)):
            value = getattr(module, attr, None)
            if not attr.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value)) \
                    and getattr(value, "__module__", "") == module.__name__:
                docs.append(inspect.getdoc(value) or "")
        texts.append("\n\n".join(d for d in docs if d))
    return texts


def prose(paragraph: str) -> str | None:
    """The paragraph as one line if it reads as prose: mostly words, sentences, no code."""
    lines = [line.strip() for line in paragraph.strip().splitlines()]
    if not lines or any(line.startswith((">>>", "...", "$", "#", "|", "-", "*", "+", "=")) for line in lines):
        return None
    text = " ".join(lines)
    words = text.split()
    if len(words) < 20 or sum(bool(re.match(r"^[A-Za-z,.;:'()\"-]+$", w)) for w in words) < 0.9 * len(words):
        return None
    return text if text.endswith((".", "!", "?")) else None


def documents() -> list[list[str]]:
    """Each document as its list of sentences (prose paragraphs only, in order)."""
    docs = []
    for text in license_texts() + docstring_texts():
        sentences = []
        for paragraph in re.split(r"\n\s*\n", text):
            if (line := prose(paragraph)) is not None:
                sentences += [s.strip() for s in SENTENCE_END.split(line) if s.strip()]
        if len(sentences) >= 4:
            docs.append(sentences)
    return docs


def same_case(word: str, like: str) -> str:
    return word.capitalize() if like[0].isupper() else word.lower()


def word_items(docs: list[list[str]], count: int, rng: random.Random) -> list[dict]:
    """Up to CONTEXT_WORDS words of a document, then its next word (4+ letters) among 3 others'."""
    words_of = [" ".join(doc).split() for doc in docs]
    vocab = [sorted({w.lower() for w in words if WORD.match(w)}) for words in words_of]
    items, tries = [], 0
    while len(items) < count and tries < 100 * count:
        tries += 1
        d = rng.randrange(len(docs))
        words = words_of[d]
        if len(words) <= CONTEXT_WORDS:
            continue
        k = rng.randrange(CONTEXT_WORDS // 2, len(words))
        answer = words[k]
        if not WORD.match(answer):
            continue
        others = [w for e in rng.sample(range(len(docs)), 8) if e != d for w in rng.sample(vocab[e], 1)]
        others = [same_case(w, answer) for w in dict.fromkeys(others) if w.lower() != answer.lower()][:3]
        if len(others) < 3:
            continue
        choices = others + [answer]
        rng.shuffle(choices)
        items.append({"context": " ".join(words[max(0, k - CONTEXT_WORDS):k]), "choices": choices,
                      "answer": choices.index(answer), "doc": d})
    return items


def sentence_items(docs: list[list[str]], count: int, rng: random.Random) -> list[dict]:
    """Up to 3 sentences of a document, then its next sentence among 3 of other documents of a
    similar length (within half to twice its words)."""
    items, tries = [], 0
    while len(items) < count and tries < 100 * count:
        tries += 1
        d = rng.randrange(len(docs))
        doc = docs[d]
        k = rng.randrange(1, len(doc))
        answer, n = doc[k], len(doc[k].split())
        if not 5 <= n <= 40:
            continue
        others = []
        for _ in range(50):
            e = rng.randrange(len(docs))
            s = rng.choice(docs[e])
            if e != d and n / 2 <= len(s.split()) <= 2 * n and s not in others:
                others.append(s)
            if len(others) == 3:
                break
        if len(others) < 3:
            continue
        choices = others + [answer]
        rng.shuffle(choices)
        items.append({"context": " ".join(doc[max(0, k - 3):k]), "choices": choices,
                      "answer": choices.index(answer), "doc": d})
    return items


def greedy_prompts(docs: list[list[str]], count: int, rng: random.Random) -> list[str]:
    """The first GREEDY_WORDS words from a random sentence on, of random documents."""
    prompts = []
    while len(prompts) < count:
        doc = rng.choice(docs)
        words = " ".join(doc[rng.randrange(len(doc)):]).split()
        if len(words) >= GREEDY_WORDS:
            prompts.append(" ".join(words[:GREEDY_WORDS]))
    return prompts


def build(seed: int, items: int = ITEMS, greedy: int = GREEDY) -> dict:
    docs = documents()
    rng = random.Random(seed)
    return {"seed": seed, "documents": len(docs),
            "tasks": {"word": word_items(docs, items, rng), "sentence": sentence_items(docs, items, rng)},
            "greedy": greedy_prompts(docs, greedy, rng)}


def load_or_build(path: str, seed: int) -> dict:
    """The items at path; built and written there first if it is not there."""
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        print(f"items: {path} ({', '.join(f'{k} {len(v)}' for k, v in data['tasks'].items())}, "
              f"greedy {len(data['greedy'])})", flush=True)
        return data
    data = build(seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"items: built from {data['documents']} documents, written to {path}", flush=True)
    return data
