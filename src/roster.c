/*
 * roster.c -- a worker's roster of stand-ins, and how a new stand-in joins
 * it (docs/architecture.md, "One owner for each fact").
 *
 * The roster lives in the worker's books (WorkerBooks, ledger_binding.c)
 * beside the C record of its charges: the books and their roster are made
 * in one step and leave the ledger in one step (Ledger.forget), so no
 * stand-in can join a roster the pool no longer sees.  It is an intrusive
 * list through the stand-ins: each listed stand-in holds its books
 * strongly and leaves the list when it is cleared or freed, so the roster
 * lists live stand-ins only, as a weak set would, without a weak reference
 * per stand-in.
 *
 * One lock: the GIL.  Every function here reads and edits the list
 * without running Python in between (no allocation of a tracked object,
 * which on 3.10 and 3.11 may run the collector and so any finalizer).
 */
#include "standin.h"

#include <stdlib.h>

static void
roster_link(PyObject *books, StandInObject *s)
{
    cs_roster *roster = cs_books_roster(books);
    s->books = Py_NewRef(books);
    s->roster_prev = roster->tail;
    s->roster_next = NULL;
    if (roster->tail != NULL) {
        roster->tail->roster_next = s;
    }
    else {
        roster->head = s;
    }
    roster->tail = s;
    roster->count++;
}

void
cs_roster_unlink(StandInObject *s)
{
    PyObject *books = s->books;
    if (books == NULL) {
        return;
    }
    cs_roster *roster = cs_books_roster(books);
    if (s->roster_prev != NULL) {
        s->roster_prev->roster_next = s->roster_next;
    }
    else {
        roster->head = s->roster_next;
    }
    if (s->roster_next != NULL) {
        s->roster_next->roster_prev = s->roster_prev;
    }
    else {
        roster->tail = s->roster_prev;
    }
    roster->count--;
    s->books = NULL;
    s->roster_prev = s->roster_next = NULL;
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
    for (StandInObject *s = roster->head; s != NULL; s = s->roster_next) {
        if (PyList_Append(list, (PyObject *)s) < 0) {
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

PyObject *
cs_roster_profile_for(PyObject *ledger, PyObject *worker,
                      PyObject *load_device, PyObject *offload_device,
                      PyObject *kind)
{
    PyObject *books = cs_ledger_find(ledger, worker);
    if (books == NULL && PyErr_Occurred()) {
        return NULL;
    }
    StandInObject *tail = books ? cs_books_roster(books)->tail : NULL;
    PyObject *profile = tail != NULL ? tail->profile : NULL;
    if (profile != NULL &&
        PyTuple_GET_ITEM(profile, PROFILE_LOAD) == load_device &&
        PyTuple_GET_ITEM(profile, PROFILE_OFFLOAD) == offload_device &&
        PyTuple_GET_ITEM(profile, PROFILE_KIND) == kind) {
        Py_INCREF(profile);
    }
    else {
        profile = NULL;
    }
    Py_XDECREF(books); /* the table still holds them: no Python runs */
    return profile ? profile
                   : PyTuple_Pack(3, load_device, offload_device, kind);
}

int
cs_standin_enlist(StandInObject *self, PyObject *ledger,
                  uint64_t generation, uint64_t size, PyObject *size_obj)
{
    Py_ssize_t id_len;
    const char *id = PyUnicode_AsUTF8AndSize(self->model_id, &id_len);
    if (id == NULL) {
        return -1;
    }
    /* The only step that may run Python (making the books). */
    PyObject *books = cs_ledger_books_for(ledger, self->worker, generation);
    if (books == NULL) {
        return -1;
    }
    /* From here to the link nothing runs Python: the record is C, and the
     * roster is edited in place. */
    cs_model *record = NULL;
    if (cs_register_model(cs_books_worker(books), generation,
                          self->model_id, id, (size_t)id_len,
                          size, size_obj, &record) < 0) {
        Py_DECREF(books);
        return -1;
    }
    self->record = record;
    roster_link(books, self);
    Py_DECREF(books); /* the stand-in holds them now */
    return 0;
}

int
cs_figures_add_roster(cs_figures *figures, cs_roster *roster)
{
    for (StandInObject *s = roster->head; s != NULL; s = s->roster_next) {
        ModuleObject *m = cs_standin_module(s);
        if (m == NULL || m->board == NULL || s->record == NULL) {
            continue; /* its figure is its receipt */
        }
        bool seen = false;
        for (size_t i = 0; i < figures->n && !seen; i++) {
            seen = figures->items[i].model == s->record;
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
