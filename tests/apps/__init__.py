#: A JSON Schema with bounded fields, for the constrained-decoding tests (a random model
#: writes digits to the token limit where an integer has no bound).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "label": {"enum": ["SUPPORTS", "REFUTES", "NOT ENOUGH INFO"]},
    },
    "required": ["name", "age", "label"],
    "additionalProperties": False,
}
