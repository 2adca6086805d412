"""Views of a Graph: networkx and Graphviz exports, a self-contained HTML viewer and a
printable summary. They only read the IR (via viz.model) and name values as the printer does;
the text form itself lives in graphdist.ir.printer."""

from graphdist.viz.dot import to_dot
from graphdist.viz.html import to_html
from graphdist.viz.nx import to_networkx
from graphdist.viz.summary import stats, summary

__all__ = ["stats", "summary", "to_dot", "to_html", "to_networkx"]
