"""Training and evaluation rows from files and hub datasets: sources and their mixtures, field
mappings and filters, the code layouts, and the reports of bad rows (docs/data.md)."""
