"""Split a markdown answer into prose and fenced code blocks, so code gets its own widget with a copy
button. An unclosed fence (an answer still streaming) counts as code up to the end."""

from __future__ import annotations

import re
from dataclasses import dataclass

_FENCE = re.compile(r"^[ ]{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^\n]*$")


@dataclass(frozen=True, slots=True)
class Segment:
    kind: str            # "text" | "code"
    text: str
    lang: str = ""
    closed: bool = True  # False for a code block whose closing fence has not arrived yet


def split_markdown(text: str) -> list[Segment]:
    segments: list[Segment] = []
    prose: list[str] = []
    code: list[str] = []
    fence = ""
    lang = ""
    for line in text.split("\n"):
        if not fence:
            m = _FENCE.match(line)
            if m:
                if prose and "".join(prose).strip():
                    segments.append(Segment("text", "\n".join(prose).strip("\n")))
                prose = []
                fence, lang, code = m.group(1), m.group(2), []
            else:
                prose.append(line)
        else:
            stripped = line.strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) <= {fence[0]}:
                segments.append(Segment("code", "\n".join(code), lang))
                fence = ""
            else:
                code.append(line)
    if fence:
        segments.append(Segment("code", "\n".join(code), lang, closed=False))
    elif prose and "".join(prose).strip():
        segments.append(Segment("text", "\n".join(prose).strip("\n")))
    return segments
