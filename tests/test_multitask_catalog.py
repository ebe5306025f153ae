"""The multitask catalogue as a whole: enough tasks in the paper's four groups, each paper task in its
Table 6 group, and a fetch manifest that pins exactly the files the converters read."""

import pytest

from fedsilo import datafetch
from fedsilo.tasks.multitask import pin
from fedsilo.tasks.multitask.catalog import CATALOG, PAPER_TASKS
from tests.mtreal import MT, needs_mt

# The FewFedWeight paper's Table 6 (its names: CrossFit's with spaces for underscores).
TABLE6 = {
    "classification": """anli, medical questions pairs, paws, glue-rte, onestop english, poem sentiment, sick, glue-sst2,
        scicite, rotten tomatoes, climate fever, glue-qqp, scitail, sms spam, dbpedia 14, emotion, glue-wnli,
        superglue-cb, emo, ethos-gender, imdb, glue-mrpc, ethos-directed vs generalized, ethos-race, tab fact,
        ethos-national origin, superglue-wic, superglue-wsc, glue-mnli, google wellformed query, wiki qa,
        hate speech18, hate speech offensive, ethos-religion, trec-finegrained, tweet eval-emoji, wiki auto,
        tweet eval-hate, tweet eval-offensive, tweet eval-sentiment, tweet eval-stance abortion,
        tweet eval-stance atheism, tweet eval-stance climate, tweet eval-stance feminist, yahoo answers topics""",
    "qa": """lama-conceptnet, adversarialqa, lama-google re, lama-squad, math qa, mc taco, aqua rat, wino grande,
        numer sense, biomrc, openbookqa, qasc, quail, quarel, quartz-no knowledge, search qa, ropes,
        quartz-with knowledge, race-middle, boolq, sciq, codah, commonsense qa, jeopardy, social i qa,
        squad-no context, duorc, squad-with context, superglue-copa, eli5-askh, swag, superglue-multirc,
        superglue-record, web questions, hellaswag, wiqa, kilt zsre, kilt nq, kilt ay2, kilt trex, cosmos qa""",
    "generation": "aeslc, spider, gigaword, xsum, kilt wow",
    "other": """acronym identification, ade corpus v2-dosage, ade corpus v2-effect, limit, app reviews, crows pairs,
        mocha, aslg pc12, blimp-anaphor gender agreement, piqa, yelp review full, proto qa, common gen,
        blimp-determiner noun agreement with adj irregular 1, qa srl, blimp-ellipsis n bar 1,
        blimp-ellipsis n bar 2, blimp-existential there quantifiers 1, hotpot qa, e2e nlg cleaned,
        blimp-anaphor number agreement, blimp-irregular past participle adjectives,
        definite pronoun resolution, break-QDMR-high-level, blimp-wh questions object gap""",
}
PAPER_GROUP = {" ".join(name.split()): group for group, names in TABLE6.items() for name in names.split(",")}


def ours() -> list[str]:
    pin.needed_files()  # loads the converters
    return [n for n in CATALOG if CATALOG.get(n).module.startswith("fedsilo.tasks.multitask.converters")]


def test_at_least_30_tasks_covering_the_four_groups():
    names = ours()
    assert len(names) >= 30
    assert {CATALOG.get(n).group for n in names} == {"classification", "qa", "generation", "other"}
    assert sum(CATALOG.get(n).in_paper for n in names) >= 30


def test_paper_tasks_sit_in_their_table6_group():
    for name in ours():
        info = CATALOG.get(name)
        assert info.in_paper == (name in PAPER_TASKS)
        paper_name = name.replace("_", " ")
        if paper_name in PAPER_GROUP:
            assert info.group == PAPER_GROUP[paper_name], name


def test_classification_tasks_are_sampled_per_class_and_metrics_are_crossfits():
    for name in ours():
        info = CATALOG.get(name)
        assert info.metric in ("acc", "em", "qa_f1", "macro_f1", "rouge_l", "mcc")
        if info.group == "generation":
            assert info.metric == "rouge_l" and not info.per_class, name
        assert info.license.strip(), name


def test_manifest_pins_exactly_the_converters_files():
    pinned = [s.path for s in datafetch.read_manifest(pin.MANIFEST)]
    assert pinned == pin.needed_files()
    assert all(s.mirror_only or len(s.commit) == 40 for s in datafetch.read_manifest(pin.MANIFEST))


@needs_mt
def test_manifest_hashes_equal_the_mirror_and_fetch_copies_them(tmp_path):
    assert [tuple(r) for r in pin.manifest_rows(MT)] == [
        (s.path, str(s.size), s.sha256, s.repo, s.repo_path, s.commit) for s in datafetch.read_manifest(pin.MANIFEST)]
    dest = datafetch.ensure("multitask", tmp_path / "copy", mirror=MT.parent, progress=False)
    copied = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert copied == pin.needed_files()


def test_fetch_without_a_mirror_names_the_mirror_only_file(tmp_path, monkeypatch):
    only = [s for s in datafetch.read_manifest(pin.MANIFEST) if s.mirror_only]
    if not only:
        pytest.skip("every multitask file has a public download")
    manifest = tmp_path / "one.tsv"
    manifest.write_text(pin.MANIFEST.read_text().splitlines()[0] + "\n" + "\t".join(
        (only[0].path, str(only[0].size), only[0].sha256, "-", only[0].repo_path, "-")) + "\n")
    monkeypatch.delenv("FEDSILO_DATA_MIRROR", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(datafetch.DataError, match="no public download"):
        datafetch.ensure("multitask", tmp_path / "dest", mirror=tmp_path / "empty", manifest=manifest, progress=False)
