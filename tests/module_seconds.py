"""Seconds per test module from a pytest JUnit XML report, longest first, as JSON (``make durations``)."""

import collections
import json
import sys
import xml.etree.ElementTree as ET

seconds: collections.Counter[str] = collections.Counter()
for case in ET.parse(sys.argv[1]).iter("testcase"):
    seconds[case.get("classname", "").split(".")[-1]] += float(case.get("time") or 0)
print(json.dumps({module: round(s) for module, s in seconds.most_common()}, indent=1))
