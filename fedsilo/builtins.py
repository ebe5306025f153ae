"""Every built-in entry that lives outside its registry's own module, registered in one place.

A registry's module defines its axis and its plain entries (weighting policies in core/weighting.py,
server optimisers in core/server_opt.py ...). Entries with code of their own live in their own
module, and importing this module registers all of them; the config imports it before it validates
a name, so every engine, CLI command and study sees the same set. A user's own entries come from
`plugins = [...]` in the config (or an import before the run), never from editing this file.
"""
from __future__ import annotations

from fedsilo.client import ditto, meta, pseudo  # after-training ditto; objective meta_weighting; hook pseudo_labels
# compression: upload transforms fp16, bf16, int8, topk; pulling: upload selectors dp_g, dp_l, random (Dynamic Pulling)
from fedsilo.core import compression, pulling
# The five tasks, in the order `fedsilo run` lists them (light modules: settings and a lazy builder).
from fedsilo.tasks.text2sql import plugin as text2sql  # isort: skip
from fedsilo.tasks.translation import plugin as translation  # isort: skip
from fedsilo.tasks.matching import plugin as matching  # isort: skip
from fedsilo.tasks.multitask import plugin as multitask  # isort: skip
from fedsilo.tasks.instruct import plugin as instruct  # isort: skip

MODULES = (ditto, meta, pseudo, compression, pulling, text2sql, translation, matching, multitask, instruct)
