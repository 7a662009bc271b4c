"""libcst codemods: each case of msrewrite.cases as a libcst `CodemodCommand`.

    python -m libcst.tool codemod --no-format -x msrewrite.codemods.moe_shared_expert.MoeSharedExpert PATH...
    python -m libcst.tool codemod --no-format -x msrewrite.codemods.any_case.AnyCase --case NAME PATH...

run a case over a whole tree with libcst's parallel runner and diff output (`-u`); each file gets
the edit `msrewrite apply --case` makes with the same options, and a file with nothing to do is
skipped with the reason. `-x` takes the full dotted path; in a checkout of msrewrite, whose
.libcst.codemod.yaml lists this package, `moe_shared_expert.MoeSharedExpert` is enough.
`--no-format`: libcst would otherwise pipe every file through black.
"""
