"""The shapes scorefn compiles: every program declared once (programs), the buckets of a plan (buckets) and how
sequences are laid out in their device batches (layout: the grid, packed rows). Pure Python; imports nothing else of
the project."""
