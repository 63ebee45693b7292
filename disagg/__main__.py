from disagg.cli import run

run()
