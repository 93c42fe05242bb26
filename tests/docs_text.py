"""Readers of README.md and docs/*.md for the tests that check their text. The README is the front
page; the topics, their measured figures and the generated sections live in docs/ (one file per
topic), so a check names the doc that holds its sentence."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")


def doc_path(name: str) -> str:
  """README.md for "README", else docs/<name>.md (e.g. "planning", "gpu-check")."""
  return os.path.join(REPO, "README.md") if name == "README" else os.path.join(DOCS, f"{name}.md")


def doc(name: str) -> str:
  return open(doc_path(name), encoding="utf-8").read()


def section(name: str, begin: str, end: str) -> str:
  """The text between a generated section's marker lines, which must occur once in the doc."""
  text = doc(name)
  assert text.count(begin) == 1 and text.count(end) == 1, (name, begin, end)
  return text.split(begin)[1].split(end)[0]
