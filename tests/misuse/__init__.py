"""The misuse tables: what a hostile or careless user tries, and the one-line refusals they get."""
