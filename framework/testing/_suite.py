"""The test module ``pytest --kvforge-conformance KIND:NAME`` collects (node id
``kvforge-conformance``). ``kvforge_case`` is parametrized by the pytest plugin
with every check of every requested suite."""


def test_conformance(kvforge_case, kvforge_options):
    kvforge_case.run(model=kvforge_options["model"], device=kvforge_options["device"], grid=kvforge_options["grid"])
