from draftsmith.cli import main

main()
