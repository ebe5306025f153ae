"""A silo is data, not code: each silo's examples come from a *source*, a config entry that names
files, their format and which column plays which role. The built-in benchmark silos are sources of
format "benchmark", so own and benchmark silos mix in one run.

Layers: `settings` (the config entry), `read` (files → rows with their file:line, malformed rows
named, never filled in), `split` (a seeded split by fraction, grouped by a key), `load` (one source's
rows per split), `check` (counts, duplicates, overlap, lengths: `fedsilo data check`) and
`fingerprint` (what each run read, so a resume reports a changed file) and `confine` (on a SuperNode,
every file a coordinator's config names must lie in the silo's own folder). Knows no model or task.
"""
