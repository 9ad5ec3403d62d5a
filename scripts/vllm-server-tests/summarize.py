"""Merge results/junit/*.xml into results/junit.xml and write results/summary.md (totals, per file, failures)."""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

res = Path(sys.argv[1])
root = ET.Element("testsuites")
rows, fails = [], []
tot = dict(passed=0, failed=0, skipped=0, errors=0)
for x in sorted((res / "junit").glob("*.xml")):
    t = ET.parse(x).getroot()
    suites = [t] if t.tag == "testsuite" else list(t)
    for s in suites:
        root.append(s)
        c = dict(passed=0, failed=0, skipped=0, errors=0)
        for tc in s.iter("testcase"):
            props = {p.get("name"): p.get("value") for p in tc.iter("property")}
            tid = f"{tc.get('classname')}::{tc.get('name')}"
            kinds = [ch.tag for ch in tc if ch.tag in ("failure", "error", "skipped")]
            if "failure" in kinds:
                k = "failed"
            elif "error" in kinds:
                k = "errors"
            elif "skipped" in kinds:
                k = "skipped"
            else:
                k = "passed"
            c[k] += 1
            if k in ("failed", "errors"):
                el = tc.find("failure") if k == "failed" else tc.find("error")
                msg = (el.get("message") or el.text or "").strip().splitlines()
                fails.append((s.get("name"), tid, k, (msg[0] if msg else "")[:300],
                              props.get("dropped_features", "")))
        for k in tot:
            tot[k] += c[k]
        rows.append((s.get("name"), c))
ET.ElementTree(root).write(res / "junit.xml", encoding="utf-8", xml_declaration=True)
out = ["# vLLM 0.33.0 server tests vs nanoserve: summary", "",
       f"Totals: {tot['passed']} passed, {tot['failed']} failed, {tot['skipped']} skipped, {tot['errors']} errors", "",
       "| file | passed | failed | skipped | errors |", "|---|---|---|---|---|"]
for name, c in rows:
    out.append(f"| {name} | {c['passed']} | {c['failed']} | {c['skipped']} | {c['errors']} |")
out += ["", "## Failures and errors", ""]
for _file, tid, k, msg, feats in fails:
    out.append(f"- [{k}] `{tid}` — {msg}" + (f"  (server dropped: {feats})" if feats else ""))
(res / "summary.md").write_text("\n".join(out) + "\n")
print("\n".join(out[:4]))
