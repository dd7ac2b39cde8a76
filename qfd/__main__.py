from qfd.cli import main

main()
