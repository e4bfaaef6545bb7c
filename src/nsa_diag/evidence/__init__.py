"""Evidence gathering: facts about the machine and the processes, collected into JSON-ready dicts."""
