"""The command line: parse, validate, call a recipe, print text or JSON. Nothing imports cli."""
