from msrewrite.cli import entry

entry()
