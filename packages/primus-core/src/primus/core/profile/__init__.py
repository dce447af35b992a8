"""Profile reports: where step time goes (compute / communication / idle; kernel categories)."""
