"""The layer tests reuse the op tests' references (test_attention_ops' layer norm formula,
test_conv's finite differences): their folder is importable from here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
