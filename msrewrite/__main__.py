from msrewrite.cli import main

main()
