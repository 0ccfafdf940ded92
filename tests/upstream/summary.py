"""Counts per file (flash-attn) and per model family (transformers) from the junit XML that
scripts/upstream_tests.sh writes: ``python tests/upstream/summary.py OUT``."""

import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(out: Path) -> None:
    for xml in sorted(out.glob("*.xml")):
        counts = collections.defaultdict(collections.Counter)
        reasons = collections.Counter()
        for case in ET.parse(xml).iter("testcase"):
            cls = case.get("classname", "")
            key = cls.split(".")[2] if cls.startswith("tests.models.") else (case.get("file") or cls)
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed"
                elif child.tag == "skipped":
                    outcome = "skipped"
                    reasons[(child.get("message") or "")[:120]] += 1
            counts[key][outcome] += 1
            if outcome == "failed":
                print(f"  FAILED {case.get('classname')}::{case.get('name')}")
        total = sum(counts.values(), collections.Counter())
        print(f"{xml.name}: {dict(total)}")
        for key, c in sorted(counts.items()):
            print(f"  {key}: {dict(c)}")
        for reason, n in reasons.most_common():
            print(f"  skipped {n}: {reason}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
