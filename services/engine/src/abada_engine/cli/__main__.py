from abada_engine.cli.app import main

main()
