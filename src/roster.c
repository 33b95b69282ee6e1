/*
 * roster.c -- a worker's roster of stand-ins, and how a new stand-in joins
 * it (docs/architecture.md, "One owner for each fact").
 *
 * The roster lives in the worker's books (WorkerBooks, binding.h) beside
 * the C record of its charges: the books and their roster are made in one
 * step and leave the ledger in one step (Ledger.forget), so no stand-in
 * can join a roster the pool no longer sees.  Each listed stand-in holds
 * its books strongly and leaves the roster when it is cleared or freed, so
 * the roster lists live stand-ins only, as a weak set would, without a
 * weak reference per stand-in.
 *
 * One lock: the GIL.  Every function here reads and edits the roster
 * without running Python in between (no allocation of a tracked object,
 * which on 3.10 and 3.11 may run the collector and so any finalizer).
 */
#include "standin.h"

#include <stdlib.h>

/* Moves the stand-ins down over the holes, in order. */
static void
roster_compact(cs_roster *roster)
{
    uint32_t to = 0;
    for (uint32_t from = 0; from < roster->used; from++) {
        StandInObject *s = roster->items[from];
        if (s != NULL) {
            s->roster_index = to;
            roster->items[to++] = s;
        }
    }
    roster->used = to;
}

/* Room for one more stand-in: 0, or -1 with MemoryError. */
static int
roster_reserve(cs_roster *roster)
{
    if (roster->used < roster->capacity) {
        return 0;
    }
    if (roster->count < roster->used / 2) {
        roster_compact(roster);
        return 0;
    }
    if (roster->capacity >= UINT32_C(1) << 29) { /* roster_index: 30 bits */
        PyErr_NoMemory();
        return -1;
    }
    uint32_t capacity = roster->capacity ? roster->capacity * 2 : 4;
    StandInObject **items =
        PyMem_Realloc(roster->items, capacity * sizeof(StandInObject *));
    if (items == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    roster->items = items;
    roster->capacity = capacity;
    return 0;
}

void
cs_roster_free(cs_roster *roster)
{
    PyMem_Free(roster->items);
    roster->items = NULL;
    roster->used = roster->capacity = roster->count = 0;
}

void
cs_roster_unlink(StandInObject *s)
{
    PyObject *books = cs_standin_books(s);
    if (books == NULL) {
        return;
    }
    cs_roster *roster = cs_books_roster(books);
    roster->items[s->roster_index] = NULL;
    roster->count--;
    while (roster->used > 0 && roster->items[roster->used - 1] == NULL) {
        roster->used--;
    }
    if (roster->count == 0) {
        cs_roster_free(roster);
    }
    else if (roster->count < roster->used / 4) {
        roster_compact(roster);
    }
    s->listed = 0;
    Py_DECREF(books); /* last: it may free the books, and their worker */
}

PyObject *
cs_roster_snapshot(cs_roster *roster)
{
    /* Made empty and filled by appending: the list's allocation may run
     * the collector, which may free listed stand-ins (they leave the
     * roster) or run finalizers that make new ones (they join it), so the
     * roster is walked only once the list exists.  Appending grows the
     * array with PyMem: nothing runs during the walk. */
    PyObject *list = PyList_New(0);
    if (list == NULL) {
        return NULL;
    }
    for (uint32_t i = 0; i < roster->used; i++) {
        StandInObject *s = roster->items[i];
        if (s != NULL && PyList_Append(list, (PyObject *)s) < 0) {
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

int
cs_standin_enlist(StandInObject *self, PyObject *ledger, PyObject *worker,
                  PyObject *model_id, uint64_t generation, uint64_t size,
                  PyObject *size_obj)
{
    Py_ssize_t id_len;
    const char *id = PyUnicode_AsUTF8AndSize(model_id, &id_len);
    if (id == NULL) {
        return -1;
    }
    /* The only step that may run Python (making the books). */
    PyObject *books = cs_ledger_books_for(ledger, worker, generation);
    if (books == NULL) {
        return -1;
    }
    /* From here to the link nothing runs Python: the record is C, and the
     * roster is edited in place. */
    cs_roster *roster = cs_books_roster(books);
    cs_model *record = NULL;
    if (roster_reserve(roster) < 0 ||
        cs_register_model(cs_books_worker(books), generation, model_id, id,
                          (size_t)id_len, size, size_obj, &record) < 0) {
        Py_DECREF(books);
        return -1;
    }
    self->record = record; /* its worker's data are these books */
    self->listed = 1;      /* the reference cs_ledger_books_for gave */
    self->roster_index = roster->used;
    roster->items[roster->used++] = self;
    roster->count++;
    return cs_standin_answer_init(self);
}

int
cs_figures_add_roster(cs_figures *figures, cs_roster *roster)
{
    for (uint32_t i = 0; i < roster->used; i++) {
        StandInObject *s = roster->items[i];
        if (s == NULL || cs_standin_board(s) == NULL) {
            continue; /* its figure is its receipt */
        }
        bool seen = false;
        for (size_t k = 0; k < figures->n && !seen; k++) {
            seen = figures->items[k].model == s->record;
        }
        if (seen) {
            continue; /* stand-ins of one model share its record */
        }
        if (figures->n == figures->cap) {
            size_t cap = figures->cap ? figures->cap * 2 : 8;
            cs_figure *grown = PyMem_Realloc(figures->items,
                                             cap * sizeof(*grown));
            if (grown == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            figures->items = grown;
            figures->cap = cap;
        }
        cs_model_incref(s->record);
        figures->items[figures->n].model = s->record;
        figures->items[figures->n].loaded = cs_standin_loaded(s);
        figures->n++;
    }
    return 0;
}

static int
figure_order(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)((const cs_figure *)a)->model;
    uintptr_t y = (uintptr_t)((const cs_figure *)b)->model;
    return x < y ? -1 : x > y;
}

void
cs_figures_sort(cs_figures *figures)
{
    if (figures->n > 1) {
        qsort(figures->items, figures->n, sizeof(cs_figure), figure_order);
    }
}

void
cs_figures_release(cs_figures *figures)
{
    for (size_t i = 0; i < figures->n; i++) {
        cs_model_decref((cs_model *)figures->items[i].model);
    }
    PyMem_Free(figures->items);
    figures->items = NULL;
    figures->n = figures->cap = 0;
}
