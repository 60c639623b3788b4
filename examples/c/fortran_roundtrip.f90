! Save real and integer arrays from Fortran and read them back, whole and by box.
!
!     make -C c fortran && c/build/fortran_roundtrip runs/fortran
!
! The same version loads in Python: fp.Repo("runs/fortran").load("main")["field"]["t"] is
! t's transpose layout (shape [3, 5] for t(5, 3)), the same bytes.
program fortran_roundtrip
  use forkpoint
  use, intrinsic :: iso_c_binding, only: c_double, c_float, c_int32_t, c_int64_t
  implicit none
  type(fp_repo) :: repo
  type(fp_save) :: save
  type(fp_version) :: v
  real(c_double) :: t(5, 3), t_back(5, 3), corner(2, 2)
  real(c_float) :: w(4)
  integer(c_int32_t) :: cells(2, 3, 2), cells_back(2, 3, 2)
  integer(c_int64_t) :: step, step_back
  character(len=FP_ID_LEN) :: id
  character(len=256) :: path
  integer :: st, i, j

  if (command_argument_count() /= 1) stop "usage: fortran_roundtrip REPO"
  call get_command_argument(1, path)
  do j = 1, 3
    do i = 1, 5
      t(i, j) = 10.0d0 * i + j + 0.25d0
    end do
  end do
  w = [1.5, -2.0, 3.25, 0.0]
  cells = reshape([(i, i = 1, 12)], shape(cells))
  step = 42

  st = fp_open(trim(path), repo, create=.true.)
  if (st == FP_OK) st = fp_save_begin(repo, "main", save)
  if (st == FP_OK) st = fp_save_set_step(save, step)
  if (st == FP_OK) st = fp_save_set_metric(save, "residual", 1.0d-6)
  if (st == FP_OK) st = fp_save_put(save, "field/t", t)
  if (st == FP_OK) st = fp_save_put(save, "field/w", w)
  if (st == FP_OK) st = fp_save_put(save, "cells", cells)
  if (st == FP_OK) st = fp_save_put(save, "step", step)
  if (st == FP_OK) then
    st = fp_save_commit(save, id)
  else
    call fp_save_abort(save)
  end if
  if (st == FP_OK) st = fp_load(repo, "main", v)
  if (st == FP_OK) st = fp_read(v, "field/t", t_back)
  if (st == FP_OK) st = fp_read(v, "cells", cells_back)
  if (st == FP_OK) st = fp_read(v, "step", step_back)
  if (st == FP_OK) st = fp_read_box(v, "field/t", [4, 2], corner)   ! t(4:5, 2:3)
  if (st /= FP_OK) then
    print "(a, i0, 2a)", "forkpoint error ", st, ": ", fp_errmsg(repo)
    call fp_close(repo)
    error stop 1
  end if
  if (any(t_back /= t) .or. any(cells_back /= cells) .or. step_back /= step .or. any(corner /= t(4:5, 2:3))) then
    print "(a)", "read back differs from what was saved"
    error stop 1
  end if
  ! a wrong shape is refused with a message saying what the leaf holds
  st = fp_read(v, "cells", t_back)
  print "(a, i0, 2a)", "reading cells into t: ", st, " ", fp_errmsg(repo)
  print "(3a)", "saved and read back version ", fp_version_id(v), " bit-exact"
  call fp_version_free(v)
  call fp_close(repo)
end program fortran_roundtrip
