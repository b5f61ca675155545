"""``python -m simulator`` runs the clustersim command line."""

from simulator.cli import main_entry

main_entry()
