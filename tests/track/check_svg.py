#!/usr/bin/env python3
"""Parses an SVG file with Python's xml.etree (so it must be well-formed XML) and prints its structure
as one JSON object on stdout:

  {"root": "svg", "title": "<title> text", "texts": [every <text>'s text],
   "polylines": [{"class", "points": number of points}], "circles": {group class: count}}

Usage: check_svg.py FILE.svg"""

import json
import sys
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"


def local(tag):
    """An element's name without the SVG namespace."""
    return tag[len(SVG):] if tag.startswith(SVG) else tag


def main():
    root = ET.parse(sys.argv[1]).getroot()
    title = root.find(SVG + "title")
    polylines = [{"class": p.get("class", ""), "points": len(p.get("points", "").split())}
                 for p in root.iter(SVG + "polyline")]
    circles = {g.get("class", ""): len(g.findall(SVG + "circle")) for g in root.iter(SVG + "g")}
    texts = ["".join(t.itertext()) for t in root.iter(SVG + "text")]
    json.dump({"root": local(root.tag), "title": title.text if title is not None else None, "texts": texts,
               "polylines": polylines, "circles": circles,
               "size": [root.get("width"), root.get("height")]}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
