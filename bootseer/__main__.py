from bootseer.cli import main

main()
