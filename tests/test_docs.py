"""README.md is a front page (at most 250 lines) and the topics live in docs/ (issue [25]): every
Markdown link in the README and in docs/*.md resolves, every doc is linked from the README and
links back to it, and each generated section sits, once, in the doc its generator writes. Files
only: no network (http(s) links are checked for their syntax)."""

import glob
import os
import re
import urllib.parse

import pytest

from tests.docs_text import DOCS, REPO, doc_path

README = os.path.join(REPO, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(DOCS, "*.md")))
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
CODE = re.compile(r"`[^`]+`")  # inline code; may wrap onto the next line
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
  """The text without code blocks, inline code and HTML comments, where brackets are not links."""
  return CODE.sub("", COMMENT.sub("", FENCE.sub("", text)))


def links(path: str) -> list[str]:
  return [target for _, target in LINK.findall(prose(open(path, encoding="utf-8").read()))]


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: link text kept, lowercase, punctuation other than '-' and '_'
  dropped, each space a '-'."""
  text = LINK.sub(r"\1", heading.strip()).lower()
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set[str]:
  """Every heading's anchor; a repeated heading gets GitHub's -1, -2, ... suffixes."""
  seen: dict[str, int] = {}
  out = set()
  for line in FENCE.sub("", open(path, encoding="utf-8").read()).splitlines():
    if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
      base = slug(m.group(1))
      n = seen.get(base, 0)
      seen[base] = n + 1
      out.add(base if n == 0 else f"{base}-{n}")
  return out


def broken(path: str, target: str) -> str | None:
  """Why a link target of the file `path` does not resolve, or None when it does."""
  if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
    url = urllib.parse.urlparse(target)
    if url.scheme in ("http", "https") and url.netloc and "." in url.netloc:
      return None
    return "not a well-formed http(s) URL"
  file_part, _, anchor = target.partition("#")
  resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
  if not os.path.exists(resolved):
    return f"{os.path.relpath(resolved, REPO)} does not exist"
  if anchor:
    if not resolved.endswith(".md"):
      return "an anchor into a file that is not Markdown"
    if anchor not in anchors(resolved):
      return f"no heading of {os.path.relpath(resolved, REPO)} has the anchor #{anchor}"
  return None


def test_the_readme_is_a_front_page():
  with open(README, encoding="utf-8") as f:
    assert len(f.read().splitlines()) <= 250


@pytest.mark.parametrize("path", PAGES, ids=lambda p: os.path.relpath(p, REPO))
def test_every_link_resolves(path):
  found = links(path)
  assert found, "no links found: the link pattern or the page is wrong"
  bad = [(target, why) for target in found if (why := broken(path, target))]
  assert not bad, bad


def test_every_doc_is_linked_from_the_readme_and_links_back():
  linked = {os.path.normpath(os.path.join(REPO, t.partition("#")[0])) for t in links(README)}
  for path in PAGES[1:]:
    assert path in linked, f"README.md does not link {os.path.relpath(path, REPO)}"
    assert any(t.partition("#")[0] == "../README.md" for t in links(path)), path


def test_a_broken_link_or_anchor_is_caught():
  """The checker itself: a missing file, a missing heading and a malformed URL are reported."""
  assert broken(README, "docs/nope.md") and broken(README, "docs/planning.md#nope")
  assert broken(README, "https:/example") and broken(README, "#no-such-heading")
  assert broken(README, "docs/planning.md#analytic-and-instant-meshtron-memory-and-meshtron-plan") \
      is None
  assert slug("Re-ranking by compiling: `plan --compile_top`") == \
      "re-ranking-by-compiling-plan---compile_top"


def generators():
  """(module, doc name) of each generated section's writer."""
  from benchmarks import gpu_report, playbook_sweep, report, step_time_anchors
  return [(report, "results"), (gpu_report, "gpu-check"), (step_time_anchors, "planning"),
          (playbook_sweep, "planning")]


def test_each_generated_section_is_once_in_its_doc():
  for module, name in generators():
    for page in PAGES:
      text = open(page, encoding="utf-8").read()
      want = 1 if page == doc_path(name) else 0
      assert text.count(module.BEGIN) == text.count(module.END) == want, (module.__name__, page)


def test_make_bench_writes_the_results_section_into_its_doc():
  makefile = open(os.path.join(REPO, "Makefile"), encoding="utf-8").read()
  (target,) = re.findall(r"-m benchmarks\.report .*--doc (\S+)", makefile)
  assert os.path.join(REPO, target) == doc_path("results")
