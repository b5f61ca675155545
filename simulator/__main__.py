"""``python -m simulator`` runs the clustersim command line."""

from simulator.cli import main_entry

if __name__ == "__main__":
    main_entry()
