"""What the project writes and how it is trusted: atomic, checksummed writes (`integrity`), the commit a result
records (`provenance`)."""
